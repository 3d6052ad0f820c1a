"""nn.Embedding without its random init. The engine builds every model on the meta device and then
loads each weight (or load_format dummy's own init), so the N(0, 1) init is never used; and on a meta
tensor the first normal_ of a process costs ~1.3 s (torch loads its Python decompositions for it):
most of a warm start's model build."""

from __future__ import annotations

import torch
from torch import nn


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """nn.Embedding(num_embeddings, embedding_dim) with uninitialized weights (on the current device)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))
