"""PoolingParams: what a pooling (embedding) request asks for, in vLLM's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """dimensions: keep the first N dimensions of the embedding and normalise again (Matryoshka
    models only; the engine checks it against the model). normalize: None takes the model's
    pooler setting (the sentence-transformers Normalize module, or --override-pooler-config).
    truncate_prompt_tokens: cut a longer prompt to this many tokens instead of refusing it (text is
    truncated by the tokenizer, keeping its special tokens; token ids keep their last N), -1: to
    the model's max_model_len."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {t}")
