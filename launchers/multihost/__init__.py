"""A multi-host cluster on one machine: network namespaces as hosts, Slurm and Ray across them."""
