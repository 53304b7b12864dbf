"""Token files (distopt.data.tokens)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from distopt.data.tokens import TokenBlocks, TokenFile, TokenWindows, collate_tokens
from distopt.errors import ConfigError


def _file(tmp_path: Path, tokens, dtype: str = "uint16", name: str = "t.bin") -> Path:
    path = tmp_path / name
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_inputs_and_shifted_targets(tmp_path: Path, dtype: str) -> None:
    vocab = 70_000 if dtype == "uint32" else 1000
    file = TokenFile(
        _file(tmp_path, np.arange(100) * (vocab // 100), dtype),
        vocab_size=vocab,
        seq_len=8,
        dtype=dtype,
    )  # type: ignore[arg-type]
    x, y = TokenWindows(file.region(), seed=3).item(0, 5)
    assert x.shape == y.shape == (8,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1]) and int(y[-1] - x[-1]) == vocab // 100


def test_window_depends_only_on_seed_rank_and_index(tmp_path: Path) -> None:
    file = TokenFile(_file(tmp_path, np.arange(10_000) % 500), vocab_size=500, seq_len=16)
    windows = TokenWindows(file.region(), seed=1)
    again = pickle.loads(pickle.dumps(TokenWindows(file.region(), seed=1)))
    assert torch.equal(windows.item(1, 42)[0], again.item(1, 42)[0])
    starts = {int(windows.item(0, i)[0][0]) for i in range(50)}
    assert len(starts) > 40  # random positions, not a fixed one
    assert not torch.equal(windows.item(0, 7)[0], windows.item(1, 7)[0])
    assert not torch.equal(windows.item(0, 7)[0], TokenWindows(file.region(), seed=2).item(0, 7)[0])


def test_split_keeps_training_windows_out_of_the_held_out_tail(tmp_path: Path) -> None:
    file = TokenFile(_file(tmp_path, np.arange(1000) % 1000), vocab_size=1000, seq_len=10)
    train, held = file.split(0.2)
    assert (train.lo, train.hi, held.lo, held.hi) == (0, 800, 800, 1000)
    windows = TokenWindows(train, seed=0)
    assert max(int(windows.item(0, i)[1][-1]) for i in range(500)) < 800
    blocks = TokenBlocks(held)
    assert (
        len(blocks) == 19
    )  # (200 - 1) // 10: every held-out token after the first is a target once
    targets = torch.cat([blocks[i][1] for i in range(len(blocks))])
    assert targets.tolist() == list(range(801, 991))
    batch = collate_tokens([blocks[0], blocks[1]])
    assert batch.inputs[0].shape == (2, 10) and batch.targets.shape == (2, 10)
    with pytest.raises(
        ConfigError, match=r"^data.holdout_fraction: 0.995 leaves 5 training tokens"
    ):
        file.split(0.995)
    with pytest.raises(
        ConfigError, match=r"^data.holdout_fraction: 0.005 leaves 5 held-out tokens"
    ):
        file.split(0.005)


@pytest.mark.parametrize(
    ("tokens", "kwargs", "message"),
    [
        (
            np.arange(10),
            {},
            r"^data.path: .*t.bin: 10 tokens, fewer than one window of seq_len \+ 1 = 17$",
        ),
        (
            np.r_[np.zeros(40), 600, 0],
            {},
            r"^data.path: .*t.bin: token id 600 at position 40 is >= vocab_size 500$",
        ),
    ],
)
def test_bad_token_files(tmp_path: Path, tokens, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TokenFile(_file(tmp_path, tokens), vocab_size=500, seq_len=16, **kwargs)


def test_missing_file_and_ragged_size(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data.eval_path: file not found: .*none.bin$"):
        TokenFile(tmp_path / "none.bin", vocab_size=10, seq_len=4, key="data.eval_path")
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 41)
    with pytest.raises(ConfigError, match=r"41 bytes is not a whole number of uint16 tokens"):
        TokenFile(path, vocab_size=10, seq_len=4)


def test_pickled_file_maps_again(tmp_path: Path) -> None:
    file = TokenFile(_file(tmp_path, np.arange(100) % 50), vocab_size=50, seq_len=4)
    copy = pickle.loads(pickle.dumps(file))
    assert copy._tokens is None and torch.equal(copy.window(3)[0], file.window(3)[0])
