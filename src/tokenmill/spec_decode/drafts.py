"""What a proposer hands the drafter for one request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Drafts:
    """What a proposer gives one request: draft tokens, and for sampled drafts the probabilities
    they were drawn from ([len(token_ids), V]; None for one-hot drafts: n-gram, suffix, argmax)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
