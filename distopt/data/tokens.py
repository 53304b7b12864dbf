"""Token files for language models: a flat binary array of token ids (``uint16`` or ``uint32``,
native byte order, no header — the nanoGPT/llm.c ``.bin`` layout without its header), read
through ``numpy.memmap`` so only the windows in use are paged in.

Training draws random windows of ``seq_len + 1`` tokens (inputs are the first ``seq_len``,
targets the last ``seq_len``). Window ``index`` of trainer ``rank`` starts at a stable hash of
``(seed, rank, index)``, so it depends on nothing else: the loader asks for windows
``step × batch_size + b`` (:class:`TokenWindows` is a :class:`distopt.data.loader.IndexedStream`), and a resumed run sees
exactly the windows an uninterrupted one would, whatever the number of loader workers.

Held-out data: a :class:`TokenRegion` is a range of token positions. ``split(fraction)`` keeps the
last ``fraction`` of the file for evaluation; training windows never cross into it. Evaluation reads
the held-out region as consecutive non-overlapping windows (:class:`TokenBlocks`), a fixed set.

Opening a file validates it: it exists, its size is a whole number of tokens, it holds at least
one window, and no token id is ``>= vocab_size``. The last check reads the whole file once
(sequentially, in 16M-token chunks: about a second per GB).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from distopt.data.batch import Batch, mix_ints
from distopt.data.loader import IndexedStream
from distopt.errors import ConfigError

TokenDtype = Literal["uint16", "uint32"]
_CHUNK = 1 << 24


class TokenFile:
    """A validated token file, memory-mapped read-only (re-mapped in each process that uses it)."""

    def __init__(
        self,
        path: str | Path,
        *,
        vocab_size: int,
        seq_len: int,
        dtype: TokenDtype = "uint16",
        key: str = "data.path",
    ) -> None:
        """Errors start with ``key``: the config key that named the file."""
        self.path = Path(path)
        if dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.token_dtype: expected 'uint16' or 'uint32', got {dtype!r}")
        self.dtype, self.vocab_size, self.seq_len = dtype, vocab_size, seq_len
        if not self.path.is_file():
            raise ConfigError(f"{key}: file not found: {self.path}")
        itemsize = np.dtype(dtype).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise ConfigError(
                f"{key}: {self.path}: {size} bytes is not a whole number of {dtype} tokens"
            )
        self.num_tokens = size // itemsize
        if self.num_tokens < seq_len + 1:
            raise ConfigError(
                f"{key}: {self.path}: {self.num_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        self._tokens: np.ndarray | None = None
        tokens = self.tokens
        for start in range(0, self.num_tokens, _CHUNK):
            chunk = tokens[start : start + _CHUNK]
            if int(chunk.max()) >= vocab_size:
                where = start + int(np.argmax(chunk >= vocab_size))
                raise ConfigError(
                    f"{key}: {self.path}: token id {int(tokens[where])} at position {where} "
                    f"is >= vocab_size {vocab_size}"
                )

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokens"] = None  # workers map the file themselves instead of copying it
        return state

    def window(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``: tokens ``start .. start + seq_len`` and the next ``seq_len``."""
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def region(self, lo: int = 0, hi: int | None = None) -> TokenRegion:
        return TokenRegion(self, lo, self.num_tokens if hi is None else hi)

    def split(
        self, fraction: float, *, key: str = "data.holdout_fraction"
    ) -> tuple[TokenRegion, TokenRegion]:
        """``(train, held_out)``: the last ``fraction`` of the tokens is held out."""
        cut = self.num_tokens - int(round(self.num_tokens * fraction))
        train, held = self.region(0, cut), self.region(cut)
        for name, part in (("training", train), ("held-out", held)):
            if part.hi - part.lo < self.seq_len + 1:
                raise ConfigError(
                    f"{key}: {fraction} leaves {part.hi - part.lo} "
                    f"{name} tokens of {self.path}, fewer than one window of "
                    f"{self.seq_len + 1}"
                )
        return train, held


class TokenRegion:
    """Token positions ``lo .. hi - 1`` of a :class:`TokenFile`."""

    def __init__(self, file: TokenFile, lo: int, hi: int) -> None:
        self.file, self.lo, self.hi = file, lo, hi

    @property
    def num_starts(self) -> int:
        """Window start positions inside the region."""
        return self.hi - self.lo - self.file.seq_len


def collate_tokens(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
    """``Batch(inputs=(tokens [B, seq_len],), targets=next tokens [B, seq_len])``."""
    return Batch((torch.stack([s[0] for s in samples]),), torch.stack([s[1] for s in samples]))


class TokenWindows(IndexedStream[tuple[torch.Tensor, torch.Tensor]]):
    """Endless random training windows of a region: window ``index`` of trainer ``rank`` is
    :meth:`item` ``(rank, index)``."""

    collate_fn = staticmethod(collate_tokens)

    def __init__(self, region: TokenRegion, *, seed: int = 0) -> None:
        self.region, self.seed = region, seed

    def item(self, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        offset = mix_ints(self.seed, rank, index) % self.region.num_starts
        return self.region.file.window(self.region.lo + offset)


class TokenBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive non-overlapping windows of a region (for evaluation: a fixed, finite set)."""

    collate_fn = staticmethod(collate_tokens)

    def __init__(self, region: TokenRegion) -> None:
        self.region = region
        self.stride = region.file.seq_len  # targets of block i end where inputs of block i+1 end

    def __len__(self) -> int:
        return max(0, (self.region.hi - self.region.lo - 1) // self.stride)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.region.file.path}: block {index} of {len(self)}")
        return self.region.file.window(self.region.lo + index * self.stride)


__all__ = ["TokenBlocks", "TokenFile", "TokenRegion", "TokenWindows", "collate_tokens"]
