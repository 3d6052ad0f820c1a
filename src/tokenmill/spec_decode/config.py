"""SpeculativeConfig: vLLM's `--speculative-config` fields, names and defaults.

Parsed from the JSON string the CLI gets (or the dict `LLM(speculative_config=...)` gets) and
validated up front, so a typo fails at start-up with a message naming the key, not mid-serving.
vLLM's rules followed here:
- method: "ngram" (alias "[ngram]"), "suffix" or "draft_model"; without a method, `model`
  "ngram"/"[ngram]" means ngram and any other model means draft_model.
- ngram: prompt_lookup_min/max default to 5/5; when only one is given the other takes its value.
- suffix: num_speculative_tokens defaults to suffix_decoding_max_tree_depth (it is only a cap:
  suffix decoding sizes each draft itself); the suffix_decoding_* defaults are vLLM's.
- draft_model: `model` is required; `quantization` and `dtype` are the draft's own (None: as the
  target). vLLM has no draft `dtype` field (its draft follows the target's); tokenmill lets the draft have its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# Mirrors tokenmill.model.layers.quantization.QUANTIZATION_METHODS (not imported: that module
# pulls in the C++ kernel loader, and a config parser should stay light).
_QUANTIZATIONS = ("int4", "int8", "gguf")
_DTYPES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")
_NGRAM_DEFAULT_N = 5  # vLLM's default window when neither bound is given


@dataclass
class SpeculativeConfig:
    method: str | None = None
    num_speculative_tokens: int | None = None
    # draft_model
    model: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    # ngram
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000  # 0: no global cache (per-request trees only)
    suffix_decoding_max_spec_factor: float = 1.0  # draft length <= factor * match length
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        self._resolve_method()
        self._check_types()
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = _NGRAM_DEFAULT_N
            self.prompt_lookup_min = hi if lo is None else lo
            self.prompt_lookup_max = lo if hi is None else hi
            if self.prompt_lookup_min < 1:
                raise ValueError(f"speculative config: prompt_lookup_min={self.prompt_lookup_min} must be >= 1")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative config: prompt_lookup_min={self.prompt_lookup_min} must be "
                    f"<= prompt_lookup_max={self.prompt_lookup_max}"
                )
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(
                f"speculative config: prompt_lookup_min/prompt_lookup_max apply to method "
                f"'ngram' only, not {self.method!r}"
            )
        if self.method == "suffix":
            self._check_suffix()
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative config: method 'draft_model' needs \"model\": the draft model's path")
            if self.quantization is not None and self.quantization not in _QUANTIZATIONS:
                raise ValueError(
                    f"speculative config: unknown quantization {self.quantization!r}; choose one of "
                    f"{', '.join(_QUANTIZATIONS)}"
                )
            if self.dtype is not None and self.dtype not in _DTYPES:
                raise ValueError(
                    f"speculative config: unknown dtype {self.dtype!r}; choose one of auto, float32, bfloat16, float16"
                )
        elif self.quantization is not None or self.dtype is not None:
            raise ValueError(
                f"speculative config: quantization/dtype apply to a draft model, not method {self.method!r}"
            )
        if self.num_speculative_tokens is None:
            raise ValueError(f"speculative config: num_speculative_tokens is required for method {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative config: num_speculative_tokens={self.num_speculative_tokens} must be >= 1")

    def _resolve_method(self) -> None:
        m = self.method
        if m is None:
            if self.model is None:
                raise ValueError(
                    'speculative config: give "method" (one of ngram, suffix, draft_model) or a draft "model"'
                )
            m = "ngram" if self.model in ("ngram", "[ngram]") else "draft_model"
        if m == "[ngram]":
            m = "ngram"
        if m not in METHODS:
            raise ValueError(f"speculative config: unknown method {m!r}; choose one of {', '.join(METHODS)}")
        if m in ("ngram", "suffix") and self.model not in (None, m, f"[{m}]"):
            raise ValueError(
                f"speculative config: method {m!r} takes no draft model (got model={self.model!r}); "
                "use method 'draft_model' for one"
            )
        if m in ("ngram", "suffix"):
            self.model = None
        self.method = m

    def _check_types(self) -> None:
        ints = (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
        )
        for name in ints:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"speculative config: {name} must be an integer, got {v!r}")
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"speculative config: {name} must be a number, got {v!r}")  # noqa: TRY004
            setattr(self, name, float(v))
        for name in ("model", "quantization", "dtype"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"speculative config: {name} must be a string, got {v!r}")

    def _check_suffix(self) -> None:
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError(
                f"speculative config: suffix_decoding_max_tree_depth={self.suffix_decoding_max_tree_depth} must be >= 1"
            )
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                f"speculative config: suffix_decoding_max_cached_requests="
                f"{self.suffix_decoding_max_cached_requests} must be >= 0"
            )
        if self.suffix_decoding_max_spec_factor < 0:
            raise ValueError(
                f"speculative config: suffix_decoding_max_spec_factor="
                f"{self.suffix_decoding_max_spec_factor} must be >= 0"
            )
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(
                f"speculative config: suffix_decoding_min_token_prob="
                f"{self.suffix_decoding_min_token_prob} must be in [0, 1]"
            )

    @classmethod
    def from_json(cls, spec: str | dict[str, Any]) -> SpeculativeConfig:
        """From `--speculative-config`'s JSON text or an already-parsed dict; ValueError on bad input."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config: not valid JSON ({e.msg} at position {e.pos})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative config: expected a JSON object, got {type(spec).__name__}")  # noqa: TRY004
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"speculative config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        return cls(**spec)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
