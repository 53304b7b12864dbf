"""Third-party model implementations, built from configs with random weights (no downloads).

Text and vision models come from Hugging Face ``transformers``; recommendation models from
``deepctr-torch``. Sizes are tiny so the whole corpus runs in CI in well under a minute.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...]]


@dataclass(frozen=True)
class CorpusEntry:
    name: str
    domain: str
    """text, vision or recommendation."""
    library: str
    """The PyPI distribution the implementation comes from."""
    build: Callable[[], Built]

    @property
    def available(self) -> bool:
        module = {"transformers": "transformers", "deepctr-torch": "deepctr_torch"}[self.library]
        return importlib.util.find_spec(module) is not None


def _ids(batch: int, length: int, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def _image(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _hf(model_cls: str, config_cls: str, inputs: Callable[[], tuple[Any, ...]], **config: Any):
    def build() -> Built:
        import transformers  # optional (distopt[coverage]), as is deepctr_torch below

        cfg = getattr(transformers, config_cls)(**config)
        return getattr(transformers, model_cls)(cfg), inputs()

    return build


_TEXT = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
)
_VISION = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    image_size=32,
    patch_size=8,
)


def _import_deepctr() -> ModuleType:
    """``deepctr_torch`` without its version check: its ``__init__`` starts a thread asking PyPI
    for a newer release, which prints a line when PyPI cannot be reached (CI, air-gapped hosts)
    and logs a warning when a newer release exists. Its ``utils`` module (no package-relative
    imports) is loaded first with the check turned off, so the package's own import of it finds
    that one."""
    if "deepctr_torch" not in sys.modules:
        package = importlib.util.find_spec("deepctr_torch")
        assert package is not None and package.submodule_search_locations is not None
        path = Path(next(iter(package.submodule_search_locations))) / "utils.py"
        spec = importlib.util.spec_from_file_location("deepctr_torch.utils", path)
        assert spec is not None and spec.loader is not None
        utils = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(utils)
        utils.check_version = lambda version: None  # type: ignore[attr-defined]
        sys.modules["deepctr_torch.utils"] = utils
    return importlib.import_module("deepctr_torch")


def _ctr(model_name: str) -> Callable[[], Built]:
    def build() -> Built:
        _import_deepctr()  # optional (distopt[coverage])
        from deepctr_torch import models
        from deepctr_torch.inputs import DenseFeat, SparseFeat

        features = [SparseFeat(f"cat{i}", vocabulary_size=50, embedding_dim=8) for i in range(4)]
        features += [DenseFeat(f"num{i}", 1) for i in range(3)]
        model = getattr(models, model_name)(features, features, device="cpu")
        gen = torch.Generator().manual_seed(1)
        x = torch.cat(
            [torch.randint(0, 50, (8, 4), generator=gen).float(), torch.randn(8, 3, generator=gen)],
            dim=1,
        )
        return model, (x,)

    return build


def corpus() -> list[CorpusEntry]:
    tf = "transformers"
    entries = [
        CorpusEntry(
            "bert", "text", tf, _hf("BertModel", "BertConfig", lambda: (_ids(2, 16),), **_TEXT)
        ),
        CorpusEntry(
            "roberta",
            "text",
            tf,
            _hf("RobertaModel", "RobertaConfig", lambda: (_ids(2, 16),), **_TEXT),
        ),
        CorpusEntry(
            "distilbert",
            "text",
            tf,
            _hf(
                "DistilBertModel",
                "DistilBertConfig",
                lambda: (_ids(2, 16),),
                vocab_size=100,
                dim=32,
                n_layers=2,
                n_heads=2,
                hidden_dim=64,
                max_position_embeddings=64,
            ),
        ),
        CorpusEntry(
            "gpt2",
            "text",
            tf,
            _hf(
                "GPT2LMHeadModel",
                "GPT2Config",
                lambda: (_ids(2, 16),),
                vocab_size=100,
                n_embd=32,
                n_layer=2,
                n_head=2,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        CorpusEntry(
            "t5",
            "text",
            tf,
            _hf(
                "T5Model",
                "T5Config",
                lambda: (_ids(2, 16), None, _ids(2, 8)),
                vocab_size=100,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
            ),
        ),
        CorpusEntry(
            "vit", "vision", tf, _hf("ViTModel", "ViTConfig", lambda: (_image(),), **_VISION)
        ),
        CorpusEntry(
            "resnet",
            "vision",
            tf,
            _hf(
                "ResNetModel",
                "ResNetConfig",
                lambda: (_image(),),
                embedding_size=16,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="basic",
            ),
        ),
        CorpusEntry(
            "convnext",
            "vision",
            tf,
            _hf(
                "ConvNextModel",
                "ConvNextConfig",
                lambda: (_image(),),
                hidden_sizes=[16, 32],
                depths=[1, 1],
                num_stages=2,
            ),
        ),
    ]
    for name in ("DeepFM", "DCN", "WDL", "xDeepFM", "AutoInt", "NFM"):
        entries.append(CorpusEntry(name.lower(), "recommendation", "deepctr-torch", _ctr(name)))
    return entries
