"""Scripts of this repository that start local Ray and Slurm clusters for trying (and testing) the
``ray`` and ``slurm`` schedulers: ``python -m launchers.ray.cluster start``,
``python -m launchers.slurm.cluster up``, and both across hosts made of network namespaces:
``python -m launchers.multihost.cluster up``. Not installed with distopt (run them from a
checkout); the TorchX components are :mod:`distopt.torchx.components`.
"""
