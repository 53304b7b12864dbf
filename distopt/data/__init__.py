"""Training data for launched jobs: sources, loaders placed by rank, held-out splits.

Sources (the ``data:`` section, :class:`DataConfig`): ``synthetic`` (:mod:`.synthetic`, the
model's example inputs), ``criteo`` (:mod:`.criteo`, click logs for DLRM), ``tokens``
(:mod:`.tokens`, token files for a GPT) and ``package.module:function`` (:mod:`.factory`).
:func:`build_data` opens them for a model; :mod:`.loader` turns datasets into endless, resumable
training loaders and unpadded held-out loaders (:mod:`.workers`: how loader workers send batches
back); :mod:`.parsed` caches the parsed form of a click log; :mod:`.generate` writes small
learnable files.
Every loader yields :class:`Batch` ``(inputs, targets)``.
"""

from distopt.data.batch import Batch, BatchCollate, to_batch
from distopt.data.build import DataSource, build_data
from distopt.data.config import DataConfig
from distopt.data.criteo import CriteoDataset, collate_criteo
from distopt.data.loader import (
    IndexedStream,
    Loader,
    build_eval_loader,
    build_loader,
    holdout_split,
)
from distopt.data.synthetic import SyntheticBatches
from distopt.data.tokens import TokenBlocks, TokenFile, TokenWindows, collate_tokens

__all__ = [
    "Batch",
    "BatchCollate",
    "CriteoDataset",
    "DataConfig",
    "DataSource",
    "IndexedStream",
    "Loader",
    "SyntheticBatches",
    "TokenBlocks",
    "TokenFile",
    "TokenWindows",
    "build_data",
    "build_eval_loader",
    "build_loader",
    "collate_criteo",
    "collate_tokens",
    "holdout_split",
    "to_batch",
]
