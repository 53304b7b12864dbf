"""What differs between the TorchX releases the tests run under (0.7 and torchx-nightly)."""

from __future__ import annotations

from typing import Any

from torchx.runner import get_runner


def slurm_options() -> str:
    """The Slurm scheduler's run options, as distopt's one-line error lists them."""
    with get_runner() as runner:
        return ", ".join(sorted(name for name, _ in runner.scheduler_run_opts("slurm")))


def dryrun_app(dryrun: Any) -> Any:
    """The AppDef of a TorchX dry run: ``app`` in torchx-nightly, ``_app`` in 0.7."""
    return dryrun.app if hasattr(dryrun, "app") else dryrun._app
