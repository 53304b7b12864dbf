"""Small data files with a signal to learn, for tests and examples (deterministic given a seed).

- :func:`write_criteo`: a Criteo-format click log whose labels follow a logistic model of two dense
  features and four categorical features, so a DLRM's held-out AUC can go well above 0.75 (the
  best achievable AUC of the default settings is about 0.89; random guessing gives 0.5). The other
  features are noise; values go missing at random and one dense feature has negatives, as in
  the real logs.
- :func:`write_tokens`: a token file drawn from a sparse Markov chain (each token has
  ``branching`` possible successors), so a language model's loss can fall from the file's unigram
  entropy (:func:`unigram_entropy`, about ``log(vocab_size)``) toward the chain's conditional
  entropy (at most ``log(branching)``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from distopt.config import check
from distopt.data.criteo import NUM_CATEGORICAL, NUM_DENSE
from distopt.data.tokens import TokenDtype

INFORMATIVE_DENSE = (0, 1)
"""Dense features (0-based: I1, I2) that move the click probability."""
INFORMATIVE_CATEGORICAL = (0, 1, 2, 5)
"""Categorical features (0-based: C1, C2, C3, C6) whose values move the click probability."""
VOCAB_SIZES = (8, 20, 50, 200, 1000)
"""Distinct values of categorical feature ``j``: ``VOCAB_SIZES[j % 5]`` by default."""


def criteo_columns(
    *,
    num_samples: int,
    seed: int = 0,
    missing: float = 0.05,
    vocab_sizes: tuple[int, ...] = VOCAB_SIZES,
    bias: float = -1.0,
    alpha: float = 0.8,
) -> tuple[list[np.ndarray], np.ndarray]:
    """The 40 text columns of :func:`write_criteo`'s lines, and each line's click probability
    (scoring lines by it gives the best achievable AUC)."""
    check(math.isfinite(alpha) and alpha > 0, "alpha", "a Zipf exponent > 0", alpha)
    rng = np.random.default_rng(seed)
    n = num_samples
    # Dense counts: log-normal integers (heavy-tailed like the real ones); I2 can be negative.
    dense = np.floor(rng.lognormal(mean=1.5, sigma=1.2, size=(n, NUM_DENSE))).astype(np.int64)
    dense[:, 1] -= rng.integers(0, 3, size=n)
    logs = np.log1p(np.maximum(dense, 0)).astype(np.float64)
    z = (logs - logs.mean(axis=0)) / (logs.std(axis=0) + 1e-9)
    logit = bias + 1.2 * z[:, INFORMATIVE_DENSE[0]] - 0.8 * z[:, INFORMATIVE_DENSE[1]]
    empty = rng.random((n, NUM_DENSE + NUM_CATEGORICAL)) < missing
    columns = [np.where(empty[:, j], "", dense[:, j].astype(str)) for j in range(NUM_DENSE)]
    for j in range(NUM_CATEGORICAL):
        vocab = vocab_sizes[j % len(vocab_sizes)]
        weights = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** alpha
        values = rng.choice(vocab, size=n, p=weights / weights.sum())
        names = np.array([f"{v:08x}" for v in rng.choice(1 << 32, size=vocab, replace=False)])
        if j in INFORMATIVE_CATEGORICAL:
            logit += rng.normal(0.0, 1.0, size=vocab)[values]
        columns.append(np.where(empty[:, NUM_DENSE + j], "", names[values]))
    probability = 1.0 / (1.0 + np.exp(-logit))
    labels = rng.random(n) < probability
    return [np.where(labels, "1", "0"), *columns], probability


def write_criteo(
    path: str | Path,
    *,
    num_samples: int,
    seed: int = 0,
    missing: float = 0.05,
    vocab_sizes: tuple[int, ...] = VOCAB_SIZES,
    bias: float = -1.0,
    alpha: float = 0.8,
) -> Path:
    """Write ``num_samples`` Criteo-format lines to ``path``; returns the path.

    Categorical feature ``j`` has ``vocab_sizes[j % len(vocab_sizes)]`` distinct values drawn with
    Zipf(``alpha``) frequencies (its ``r``-th most frequent value with probability ∝ ``r^-alpha``).
    The click logit is ``bias + 1.2·z(log(1 + I1)) − 0.8·z(log(1 + I2)) + Σ effect_j[value]``
    over the informative categorical features (effects ~ N(0, 1)), where ``z`` standardizes;
    ``missing`` is the chance that any one feature is empty (the logit uses the
    value before it went missing, so missing values are noise, as in real logs).
    """
    columns, _ = criteo_columns(
        num_samples=num_samples,
        seed=seed,
        missing=missing,
        vocab_sizes=vocab_sizes,
        bias=bias,
        alpha=alpha,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = zip(*(column.tolist() for column in columns), strict=True)
    path.write_text("".join("\t".join(row) + "\n" for row in rows))
    return path


def markov_chain(vocab_size: int, branching: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(successors [V, branching], probabilities [V, branching])`` of a random sparse chain."""
    rng = np.random.default_rng(seed)
    successors = np.stack(
        [rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
    )
    probabilities = rng.dirichlet(np.ones(branching), size=vocab_size)
    return successors, probabilities


def write_tokens(
    path: str | Path,
    *,
    num_tokens: int,
    vocab_size: int = 64,
    branching: int = 4,
    seed: int = 0,
    dtype: TokenDtype = "uint16",
) -> Path:
    """Write ``num_tokens`` tokens of a random Markov chain (see :func:`markov_chain`)."""
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"vocab_size {vocab_size} does not fit {dtype}")
    successors, probabilities = markov_chain(vocab_size, branching, seed)
    cumulative = np.cumsum(probabilities, axis=1)
    rng = np.random.default_rng(seed + 1)
    draws = rng.random(num_tokens)
    tokens = np.empty(num_tokens, dtype=dtype)
    current = int(rng.integers(vocab_size))
    for i in range(num_tokens):
        tokens[i] = current
        choice = min(int(np.searchsorted(cumulative[current], draws[i])), branching - 1)
        current = int(successors[current, choice])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path)
    return path


def unigram_entropy(path: str | Path, *, dtype: TokenDtype = "uint16") -> float:
    """Entropy in nats of the token frequencies of ``path``: the loss of the best model that
    ignores context (a language model that learns anything gets below it)."""
    counts = np.bincount(np.memmap(path, dtype=dtype, mode="r"))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def chain_entropy(vocab_size: int, branching: int, seed: int) -> float:
    """Conditional entropy in nats of :func:`markov_chain`'s next token, averaged uniformly over the
    current token (an estimate of the best achievable loss; the stationary weighting differs)."""
    _, probabilities = markov_chain(vocab_size, branching, seed)
    return float(-(probabilities * np.log(probabilities)).sum(axis=1).mean())


def main(argv: list[str] | None = None) -> int:
    """``python -m distopt.data.generate {criteo,tokens} PATH [--samples N] [--seed S]``: write a
    file for an example job (prints the unigram entropy of a token file)."""
    parser = argparse.ArgumentParser(
        prog="python -m distopt.data.generate", description=main.__doc__
    )
    parser.add_argument("kind", choices=("criteo", "tokens"))
    parser.add_argument("path")
    parser.add_argument("--samples", type=int, default=100_000, help="lines or tokens")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="tokens: vocabulary size (default 64); criteo: distinct values of every categorical "
        "feature (default 8, 20, 50, 200 or 1000 by feature)",
    )
    parser.add_argument(
        "--alpha", type=float, default=0.8, help="criteo: Zipf exponent of categorical values"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.kind == "criteo":
        written = write_criteo(
            args.path,
            num_samples=args.samples,
            seed=args.seed,
            alpha=args.alpha,
            vocab_sizes=VOCAB_SIZES if args.vocab_size is None else (args.vocab_size,),
        )
        print(written)
    else:
        path = write_tokens(
            args.path, num_tokens=args.samples, vocab_size=args.vocab_size or 64, seed=args.seed
        )
        print(f"{path} (unigram entropy {unigram_entropy(path):.3f} nats)")
    return 0


__all__ = [
    "INFORMATIVE_CATEGORICAL",
    "INFORMATIVE_DENSE",
    "VOCAB_SIZES",
    "chain_entropy",
    "criteo_columns",
    "markov_chain",
    "unigram_entropy",
    "write_criteo",
    "write_tokens",
]

if __name__ == "__main__":
    raise SystemExit(main())
