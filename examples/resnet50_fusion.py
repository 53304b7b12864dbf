"""ResNet-50-shaped CNN: fold conv+BatchNorm and switch to channels-last for inference.

    python examples/resnet50_fusion.py

Prints what distopt changed (``distopt.explain``) and eager vs optimized latency.
"""

from __future__ import annotations

import time

import torch

import distopt
from distopt.models import build, make_inputs


def latency(fn, x: torch.Tensor, repeats: int = 5) -> float:
    fn(x)  # warm-up: oneDNN picks kernels on the first call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    model = build("resnet50", width=32, image_size=96, num_classes=100).eval()
    (x,) = make_inputs("resnet50", model, batch_size=8)
    # Folding is exact only in eval mode; gradients are not compared (the folded graph is for inference).
    fast = distopt.optimize(
        model,
        x,
        passes=["fold_conv_bn", "channels_last"],
        config={"verify": {"check_grads": False, "rtol": 1e-3, "atol": 1e-3}},
    )
    distopt.explain(fast)
    with torch.no_grad():
        eager_s, fast_s = latency(model, x), latency(fast, x)
    print(f"eager {eager_s * 1e3:.1f} ms, distopt {fast_s * 1e3:.1f} ms ({eager_s / fast_s:.2f}×)")
    # Checkpoints are interchangeable: same keys, and loading re-folds the weights.
    assert list(fast.state_dict()) == list(model.state_dict())


if __name__ == "__main__":
    main()
