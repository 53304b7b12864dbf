"""A GPT on a token file with FSDP2 (``distopt.parallelize``) in bf16, two trainers.

    python examples/gpt_fsdp.py [--tokens 30000] [--steps 60] [--out runs/examples/gpt]

Writes a token file from a Markov chain (``distopt.data.generate``; its unigram entropy is the
loss of a model that ignores context), launches ``configs/jobs/gpt_tokens.yaml`` through TorchX
on ``local_cwd`` (``torchrun`` starts two trainers), and prints the held-out loss against that
entropy: a model that learned the chain gets well below it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import distopt
from distopt.data.generate import unigram_entropy, write_tokens
from distopt.metrics import load_run

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "jobs" / "gpt_tokens.yaml"


def run(num_tokens: int, steps: int, out: Path) -> tuple[float, float]:
    """``(held-out loss, unigram entropy)`` in nats (exits non-zero on a failed job)."""
    tokens = write_tokens(out / "tokens.bin", num_tokens=num_tokens, vocab_size=64, seed=0)
    entropy = unigram_entropy(tokens)
    job = distopt.launch(
        CONFIG, "local_cwd",
        overrides=[f"data.path={tokens}", f"output_dir={out}", f"steps={steps}",
                   "variant=optimized"],  # distopt.parallelize: FSDP2 units from the graph
        run_id="gpt-fsdp", num_trainers=2, log_dir=str(out / "torchx"),
    )  # fmt: skip
    with job:
        status = job.wait()
        print(f"{job.handle} {status.state}", flush=True)
        report = job.failure_report(status)  # which process failed first, and its error
    if report is not None:
        sys.exit(f"{report}\nlogs under {out / 'torchx'}")
    loss = load_run(job.run_dir).ranks[0].evals[-1].metrics["eval_loss"]
    print(f"held-out loss {loss:.3f} nats vs unigram entropy {entropy:.3f} nats")
    return loss, entropy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=30_000, help="tokens in the file")
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--out", type=Path, default=Path("runs/examples/gpt"))
    args = parser.parse_args(argv)
    loss, entropy = run(args.tokens, args.steps, args.out)
    return 0 if loss < entropy else 1


if __name__ == "__main__":
    sys.exit(main())
