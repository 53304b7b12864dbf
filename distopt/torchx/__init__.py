"""Launching distopt jobs with TorchX.

:mod:`.components` holds the components ``ps_job`` and ``spmd`` (DDP or FSDP),
which the ``torchx.components`` entry point names ``distopt.ps_job`` and ``distopt.spmd``
(``torchx run -s local_cwd distopt.ps_job --config ...``); :mod:`.component_checks` holds the checks they
run on the submitting machine. :mod:`.ray_scheduler` is a TorchX scheduler for Ray on Ray's job
submission API, whose jobs run :mod:`.ray_job_driver`; :mod:`.schedulers` hands it to TorchX's
Runner (``distopt_ray``, and ``ray`` where TorchX has none) without registering it with TorchX.
The local Ray and Slurm clusters used to try the ``ray`` and ``slurm`` schedulers are scripts of
the repository (``launchers/``), not part of the package.
"""
