"""Watermarking (Kirchenbauer et al. 2023, "A Watermark for Large Language Models"), as TGI ships it.

At each step the previous token seeds a generator that splits the vocabulary into a "green"
fraction gamma and the rest; delta is added to the green logits before sampling, so green
tokens become more likely. The detector needs no model: it re-derives each step's green list
from the tokens alone and counts green tokens; without a watermark about gamma of them are
green, so the z-score of the count says how unlikely the text is to be unwatermarked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.config import WatermarkConfig
from tokenmill.model.loader import load_hf_config, resolve_model_path
from tokenmill.tokenizer import load_tokenizer

HASH_KEY = 15485863  # TGI's (a large prime): the seed is HASH_KEY * previous token id


def greenlist(prev_token: int, vocab_size: int, gamma: float) -> torch.Tensor:
    """The green token ids after `prev_token`."""
    g = torch.Generator().manual_seed(HASH_KEY * prev_token)
    return torch.randperm(vocab_size, generator=g)[: int(vocab_size * gamma)]


def apply_watermark(logits: torch.Tensor, rows: list[int], prev_tokens: list[int], cfg: WatermarkConfig) -> None:
    """In place: add delta to the green logits of the given rows."""
    if not rows:
        return
    V = logits.shape[-1]
    # Green lists come from CPU generators (the detector re-derives them there); all rows' go to
    # the logits' device as one index and are added in one op.
    cols = torch.cat([greenlist(prev, V, cfg.gamma) for prev in prev_tokens])
    index = torch.stack([torch.tensor(rows).repeat_interleave(len(cols) // len(rows)), cols])
    if logits.device.type == "cuda":  # from pinned memory: a pageable source may wait for the stream
        index = index.pin_memory().to(logits.device, non_blocking=True)
    elif logits.device.type != "cpu":
        index = index.to(logits.device)
    logits[index[0], index[1]] += cfg.delta


@dataclass
class WatermarkScore:
    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float

    def detected(self, threshold: float = 4.0) -> bool:
        return self.z_score > threshold


def detect(token_ids: list[int], vocab_size: int, gamma: float = 0.5) -> WatermarkScore:
    """Score a token sequence: each token after the first is checked against the green list its
    predecessor seeds. The prompt's last token can lead `token_ids` to score the first output."""
    T = len(token_ids) - 1
    if T < 1:
        raise ValueError("need at least 2 tokens to score a watermark")
    green = 0
    for prev, tok in zip(token_ids, token_ids[1:]):
        green += bool((greenlist(prev, vocab_size, gamma) == tok).any())
    z = (green - gamma * T) / math.sqrt(T * gamma * (1 - gamma))
    return WatermarkScore(T, green, green / T, z)


def detect_text(text: str, model: str | None = None, gamma: float = 0.5) -> WatermarkScore:
    """Score text as the model's tokenizer splits it (no model weights needed)."""
    path = resolve_model_path(model)
    ids = load_tokenizer(path).encode(text, add_special_tokens=False)
    return detect(ids, load_hf_config(path).vocab_size, gamma)
