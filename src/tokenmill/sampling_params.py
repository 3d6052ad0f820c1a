"""SamplingParams: per-request generation controls, in vLLM / OpenAI vocabulary."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


@dataclass
class GuidedDecodingParams:
    """One of these (vLLM's names): a JSON schema, any JSON object, a regex, a list of choices,
    or a grammar (Lark, or GBNF as llama.cpp writes it)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"guided decoding needs exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("guided choice must be a non-empty list of non-empty strings")

    def to_grammar(self) -> str:
        """The llguidance grammar for these constraints."""
        from llguidance import grammar_from
        from llguidance.gbnf_to_lark import any_to_lark

        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return grammar_from("json_schema", schema)
        if self.json_object:
            return grammar_from("json_schema", json.dumps({"type": "object"}))
        if self.regex is not None:
            return grammar_from("regex", self.regex)
        if self.choice is not None:
            return grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in self.choice))
        try:
            lark = any_to_lark(self.grammar)  # GBNF (llama.cpp's `root ::= ...`) becomes Lark; Lark stays
        except Exception as e:  # noqa: BLE001 - the converter's own error types
            raise ValueError(f"invalid grammar: {e}") from None
        return grammar_from("lark", lark)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Defaults follow vLLM: temperature 1.0, no top-k/top-p/min-p truncation, 16 new tokens.
    temperature == 0 means greedy (exact argmax).

    Every float must be finite (NaN compares false with every bound, and a NaN or infinite
    temperature or penalty turns the logits into NaN: the sampler then picks token 0 forever).
    Ranges beyond vLLM's: temperature <= TEMPERATURE_MAX (the sampler divides float32 logits by
    it: a huge one overflows to inf and -inf / inf is NaN; 100 already flattens any practical
    distribution to near-uniform) and repetition_penalty in
    [REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX] (logits are divided or multiplied by it: 1e-300
    is 0 in float32 and every logit becomes inf), top_k below 2**31 (a torch index) and seed in
    the signed 64-bit range (torch.Generator.manual_seed).
    """

    TEMPERATURE_MAX = 100.0
    REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
    TOP_K_MAX = 2**31 - 1
    SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

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

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            try:
                finite = math.isfinite(v)
            except TypeError:
                finite = False
            if not finite:
                bad(f"{name} must be a finite number, got {v!r}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            bad(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        if not 0.0 <= self.temperature <= self.TEMPERATURE_MAX:
            bad(f"temperature must be in [0, {self.TEMPERATURE_MAX:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= self.TOP_K_MAX:
            bad(f"top_k must be -1 (disable), 0 (disable) or in [1, {self.TOP_K_MAX}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.REPETITION_PENALTY_MIN <= self.repetition_penalty <= self.REPETITION_PENALTY_MAX:
            bad(
                f"repetition_penalty must be in [{self.REPETITION_PENALTY_MIN:g}, {self.REPETITION_PENALTY_MAX:g}] "
                f"(1 disables), got {self.repetition_penalty}"
            )
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
            bad("logit_bias values must be in [-100, 100]")  # NaN fails the comparison too
        if self.seed is not None and not self.SEED_MIN <= self.seed <= self.SEED_MAX:
            bad(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
        if any(not w.strip() for w in self.bad_words):  # type: ignore[union-attr]
            bad("bad_words must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    def children(self) -> list[SamplingParams]:
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

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
