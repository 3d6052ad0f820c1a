"""Structured output: constrain sampling to a JSON schema, a regex, a choice or a grammar.

llguidance (a Rust grammar engine, from PyPI) does the work: a matcher per request follows the
tokens it has produced and computes, at each step, the bitmask of tokens that keep the output
inside the grammar. The sampler fills the masks of every constrained row of the batch into one
bitmask tensor and applies it to all the logits at once. A grammar is compiled once; later
requests with the same grammar get a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch


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
            raise ValueError(f"guided decoding needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")
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


class StructuredOutputManager:
    """Per engine: the llguidance tokenizer (built on first use) and compiled grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 256):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # requests are built on the server's thread too

    @property
    def lltokenizer(self):
        if self._lltok is None:
            import llguidance.hf

            self._lltok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=self.eos_token_ids or None)
        return self._lltok

    def matcher_for(self, params: GuidedDecodingParams):
        """A fresh matcher for one request; ValueError if the grammar does not compile."""
        from llguidance import LLMatcher

        grammar = params.to_grammar()
        with self._lock:
            template = self._compiled.get(grammar)
            if template is None:
                template = LLMatcher(self.lltokenizer, grammar)
                if template.is_error():
                    raise ValueError(f"invalid guided decoding grammar: {template.get_error()}")
                self._compiled[grammar] = template
                if len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return template.deep_copy()

    def allows_only_eos(self, matcher) -> bool:
        """True when the matcher's next token can only be EOS (the grammar accepts nothing more)."""
        import numpy as np

        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        return set(allowed.tolist()) <= set(self.eos_token_ids)


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor | None:
    """In place: mask the logits of every row whose matcher is not None to its allowed tokens,
    in one pass over those rows; returns those rows' [R, V] allowed mask (None when no row has a
    matcher). llguidance fills an int32 bitmask on the CPU; it goes to the logits' device in one
    copy and is unpacked there. Eager torch: llguidance's own apply_token_bitmask_inplace is
    torch.compile'd, and its first call (on the engine thread) compiled for 8-15 s."""
    import llguidance.torch as lt

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    vocab, dev = logits.shape[1], logits.device
    bitmask = lt.allocate_token_bitmask(len(rows), vocab)  # pinned when CUDA is there: an async copy
    for k, i in enumerate(rows):
        fill_at = getattr(matchers[i], "fill_bitmask", None)  # a draft position's state (spec_decode)
        if fill_at is not None:
            fill_at(lt.fill_next_token_bitmask, bitmask, k)
        else:
            lt.fill_next_token_bitmask(matchers[i], bitmask, k)
    if dev.type != "cpu":
        bitmask = bitmask.to(dev, non_blocking=True)
    bits = (bitmask.unsqueeze(-1) >> _bit_shifts(dev)) & 1  # [R, W, 32]: bit b of word w is token 32 w + b
    allowed = bits.view(len(rows), -1)[:, :vocab].bool()
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows)
        if dev.type == "cuda":  # from pinned memory: a pageable source may wait for the stream
            index = index.pin_memory().to(dev, non_blocking=True)
        elif dev.type != "cpu":
            index = index.to(dev)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return allowed


_BIT_SHIFTS = {torch.device("cpu"): torch.arange(32, dtype=torch.int32)}  # per device, made once


def _bit_shifts(dev: torch.device) -> torch.Tensor:
    t = _BIT_SHIFTS.get(dev)
    if t is None:
        t = _BIT_SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    return t
