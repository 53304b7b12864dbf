"""A local single-host Slurm cluster for running distopt jobs through TorchX."""
