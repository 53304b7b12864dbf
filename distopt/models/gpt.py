"""A GPT-style decoder: token + position embeddings, a stack of pre-norm attention/MLP blocks."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from distopt.models import register_model


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        # The mask is derived from ``att`` itself so symbolic tracing needs no concrete sizes.
        future = torch.ones_like(att, dtype=torch.bool).tril().logical_not()
        att = att.masked_fill(future, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        seq_len: int = 32,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _inputs(model: nn.Module, batch_size: int, seed: int) -> tuple[torch.Tensor]:
    vocab_size, seq_len = cast(int, model.vocab_size), cast(int, model.seq_len)  # plain ints of GPT
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen),)


@register_model("gpt", inputs=_inputs)
def gpt(
    vocab_size: int = 256,
    dim: int = 64,
    heads: int = 4,
    layers: int = 2,
    seq_len: int = 32,
    dropout: float = 0.1,
) -> GPT:
    return GPT(vocab_size, dim, heads, layers, seq_len, dropout)
