"""Embedding shards as Ray actors, on the cluster at $RAY_ADDRESS."""

import os

import ray
import torch

import distopt


def connect():
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), namespace="raytables",
             ignore_reinit_error=True, log_to_driver=False)


@ray.remote(num_cpus=0)
class Shard:
    def __init__(self, rows, dim, seed):
        self.weight = 0.05 * torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))

    def lookup(self, ids):
        return self.weight[ids]

    def apply(self, ids, grad, lr):
        self.weight.index_add_(0, ids.reshape(-1), grad.reshape(-1, self.weight.shape[1]), alpha=-lr)


distopt.register_read(Shard.lookup)
distopt.register_write(Shard.apply)
