"""SamplingParams: per-request generation controls, in vLLM / OpenAI vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.structured_output import GuidedDecodingParams


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Defaults follow vLLM: temperature 1.0, no top-k/top-p/min-p truncation, 16 new tokens.
    temperature == 0 means greedy (exact argmax).
    """

    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # completions generated per prompt; the n most likely are returned
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; N: plus top N
    prompt_logprobs: int | None = None  # logprobs of each prompt token (after the first), plus top N
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] | None = None  # words never generated (every tokenization the engine tries)
    watermark: bool = False  # Kirchenbauer et al. green-list watermark (the engine's gamma / delta)
    guided_decoding: GuidedDecodingParams | None = None  # JSON schema / regex / choice / grammar
    # Filled in by the engine from the tokenizer / generation config.
    _eos_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            bad(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            bad("stop strings must be non-empty")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias values must be in [-100, 100]")
        if any(not w.strip() for w in self.bad_words):  # type: ignore[union-attr]
            bad("bad_words must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    def children(self) -> list["SamplingParams"]:
        """One n=1 request per sample (vLLM V1 fans out the same way); child i of a seeded
        request gets seed + i, so the samples differ but stay reproducible."""
        out = []
        for i in range(self.num_samples):
            c = self.clone()
            c.n, c.best_of = 1, None
            if c.seed is not None:
                c.seed += i
            if self.num_samples > self.n and c.logprobs is None:
                c.logprobs = 0  # best_of ranks by cumulative logprob
            out.append(c)
        return out

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
