"""A local, loopback-only Ray cluster for running distopt jobs through TorchX."""
