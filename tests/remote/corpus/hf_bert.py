"""A transformers model (BERT) reading two remote tables, with data-dependent control flow: the
model needs Dynamo (symbolic tracing stops at the branch)."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc
from torch import nn
from transformers import BertConfig, BertModel

from tests.remote.corpus import common
from tests.remote.corpus.rpc_utils import _parameter_rrefs, _remote_method
from tests.remote.corpus.rref_helper import _remote_method_async
from tests.remote.corpus.tables import DIM, NUM_ROWS, EmbeddingTable


class Model(nn.Module):
    def __init__(self, seed: int = 0, servers=common.SERVERS):
        super().__init__()
        self.emb0_rref = rpc.remote(servers[0], EmbeddingTable, args=(NUM_ROWS, DIM, seed))
        self.emb1_rref = rpc.remote(servers[1], EmbeddingTable, args=(NUM_ROWS, DIM, seed + 1))
        self.tower = common.tower()
        config = BertConfig(
            vocab_size=8,
            hidden_size=DIM,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=2 * DIM,
            max_position_embeddings=8,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = BertModel(config, add_pooling_layer=False)
        self.head = common.head()

    def forward(self, dense, ids):
        h = self.tower(dense)
        e0 = _remote_method(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        e1 = _remote_method(EmbeddingTable.forward, self.emb1_rref, ids[:, 1])
        tokens = torch.stack([h, e0, e1], dim=1)
        if tokens.abs().mean() > 10.0:  # rare outliers: scale down (a data-dependent branch)
            tokens = tokens / 10.0
        return self.head(self.bert(inputs_embeds=tokens).last_hidden_state.flatten(1))


class HandAsync(Model):
    def forward(self, dense, ids):
        f0 = _remote_method_async(EmbeddingTable.forward, self.emb0_rref, ids[:, 0])
        f1 = _remote_method_async(EmbeddingTable.forward, self.emb1_rref, ids[:, 1])
        h = self.tower(dense)
        tokens = torch.stack([h, f0.wait(), f1.wait()], dim=1)
        if tokens.abs().mean() > 10.0:
            tokens = tokens / 10.0
        return self.head(self.bert(inputs_embeds=tokens).last_hidden_state.flatten(1))


def build(seed: int = 0, hand: bool = False) -> Model:
    return common.seeded(seed, (HandAsync if hand else Model)(seed))


def remote_parameters(model: Model) -> list:
    return [
        p for r in (model.emb0_rref, model.emb1_rref) for p in _remote_method(_parameter_rrefs, r)
    ]
