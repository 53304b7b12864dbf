"""What the order of turns costs ps_overlap's optimized model at one point: an A/A check.

    python tools/turn_order.py --backend ray --latency-ms 5 --compute heavy --rounds 30
    python tools/turn_order.py ... --control      # the hand-written model in the optimized turn
    python tools/turn_order.py ... --rotated      # the order rotated each round, as before

One table (K = 1), real servers, chunks of 30 steps of the model as written, the optimized model
and the hand-written async model, taking turns as ``distopt bench configs/bench/ps_overlap.yaml``
does (``--rotated``: as it did before ``distopt.bench.order``). Prints each variant's median
step, H = (T_base − T_opt) / (T_base − T_hand) from them, and in how many rounds the optimized
turn was slower than the hand-written one. With ``--control`` the optimized turn runs a second
hand-written model: whatever H it scores is the order's and the host's, not distopt's.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import distopt
import distopt.ps as ps
from distopt.bench.order import balanced_orders
from distopt.bench.ps_overlap import _train_chunk
from distopt.models.dlrm import DLRM, DLRMConfig, DLRMHandAsync, dlrm_tables, make_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("rpc", "ray"), default="ray")
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--compute", choices=("light", "heavy"), default="heavy")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--control", action="store_true")
    parser.add_argument("--rotated", action="store_true")
    args = parser.parse_args()
    cfg = DLRMConfig(num_tables=1, compute=args.compute, batch_size=64)
    options = ps.ServerOptions(backend=args.backend, num_servers=1, latency_ms=args.latency_ms)
    batches = [make_batch(cfg, i) for i in range(30)]
    with ps.local_job(dlrm_tables(cfg), options):
        baseline = DLRM(cfg)
        example = (batches[0].dense, batches[0].sparse)
        optimized = distopt.optimize(copy.deepcopy(baseline), example, strict=True)
        ps.discard_step()
        models = {
            "baseline": baseline,
            "optimized": DLRMHandAsync(cfg) if args.control else optimized,
            "hand": DLRMHandAsync(cfg),
        }
        names = list(models)
        sgd = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
        if args.rotated:
            orders = [names[r % 3 :] + names[: r % 3] for r in range(args.rounds + 1)]
        else:
            orders = balanced_orders(names, args.rounds + 1, turns="chunks")
        steps: dict[str, list[float]] = {name: [] for name in names}
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for index, order in enumerate(orders):
            for name in order:
                chunk = _train_chunk(
                    models[name], cfg, batches, sgd[name], blocking_push=name == "baseline", lr=0.01
                )[3:]
                if index:  # the first round warms up
                    steps[name] += chunk
                    rounds[name].append(statistics.median(chunk))
    median = {name: statistics.median(values) for name, values in steps.items()}
    base, opt, hand = median["baseline"], median["optimized"], median["hand"]
    slower = sum(o > h for o, h in zip(rounds["optimized"], rounds["hand"], strict=True))
    turn = "hand-written (control)" if args.control else "optimized"
    print(", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in median.items()))
    print(f"H {(base - opt) / (base - hand):.2f}; the {turn} turn slower in {slower}/{args.rounds}")


if __name__ == "__main__":
    main()
