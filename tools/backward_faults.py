"""What a backward of ps_overlap's heavy DLRM costs in page faults, by how its grads are let go.

    python tools/backward_faults.py --grads none       # set to None (the rehearsal's way)
    python tools/backward_faults.py --grads optimizer  # optimizer.step() and zero_grad() (a run's)
    python tools/backward_faults.py --grads zero       # zeroed in place

Run each in a fresh process: the point is the heap a process built before, so modes must not
share one. Real servers (one, no injected latency); prints the median backward and the median
count of minor page faults per backward over the steps after ``--skip``
(docs/cost_model.md, "The rehearsed backward pays page faults").
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import distopt.ps as ps
from distopt.models.dlrm import DLRM, DLRMConfig, dlrm_tables, make_batch


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grads", choices=("none", "optimizer", "zero"), required=True)
    parser.add_argument("--tables", type=int, default=16)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    cfg = DLRMConfig(num_tables=args.tables, compute="heavy", batch_size=64)
    batch = make_batch(cfg, 0)
    times, faults = [], []
    with ps.local_job(dlrm_tables(cfg), ps.ServerOptions(num_servers=1)):
        model = DLRM(cfg)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(args.steps):
            loss = model(batch.dense, batch.sparse).float().sum()
            before, start = _minor_faults(), time.perf_counter()
            loss.backward()
            took, faulted = time.perf_counter() - start, _minor_faults() - before
            ps.discard_step()  # the step's push is not sent: this times the backward alone
            if args.grads == "optimizer":
                optimizer.step()
                optimizer.zero_grad()
            else:
                model.zero_grad(set_to_none=args.grads == "none")
            if step >= args.skip:
                times.append(took)
                faults.append(faulted)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"grads {args.grads}: {params:.1f}M parameters, median backward "
        f"{1e3 * statistics.median(times):.1f} ms, {statistics.median(faults):.0f} minor page "
        f"faults per backward (steps {args.skip}-{args.steps - 1})"
    )


if __name__ == "__main__":
    main()
