"""Structured output: constrain sampling to a JSON schema, a regex, a choice or a grammar.

llguidance (a Rust grammar engine, from PyPI) does the work: a matcher per request follows the
tokens it has produced and computes, at each step, the bitmask of tokens that keep the output
inside the grammar. The sampler fills the masks of every constrained row of the batch into one
bitmask tensor and applies it to all the logits at once. A grammar is compiled once; later
requests with the same grammar get a copy of the compiled matcher.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.sampling_params import GuidedDecodingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

logger = logging.getLogger("tokenmill")


class StructuredOutputManager:
    """Per engine: the grammar backend (llguidance's view of the tokenizer, built once) and the
    compiled grammars.

    Building the backend takes ~0.7 s that holds the GIL (llguidance parses the tokenizer in Rust
    without releasing it), so every other thread, the engine's included, stalls meanwhile. A server
    builds it in the background once it is ready (`start_background_init`); a grammar request that
    comes first waits for it on the request-preparation pool, never on the engine thread or the
    event loop. Without that call (offline), the first grammar builds it."""

    PROBE_TOKENS = 32  # tokens of the longest-token walk that checks a new grammar (see _probe)

    # hf_tokenizer: a Hugging Face fast tokenizer (llguidance.hf reads its tokenizers backend)
    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int = 256
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._lltok: LLTokenizer | None = None
        self._token_bytes: np.ndarray | None = None  # each token's length in bytes (0: special), for _probe
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # requests are built on the server's thread too
        self._init_lock = threading.Lock()  # held while the backend is built: later grammars wait on it
        self._init_thread: threading.Thread | None = None
        self.initialised = threading.Event()  # the backend is built
        self.built_on: str | None = None  # the thread that built it (tests look)

    def start_background_init(self) -> None:
        """Build the backend on a thread of its own, now (idempotent)."""
        with self._lock:
            if self._init_thread is not None or self.initialised.is_set():
                return
            self._init_thread = threading.Thread(
                target=self._init_in_background, name="tokenmill-grammar-init", daemon=True
            )
            self._init_thread.start()

    def _init_in_background(self) -> None:
        try:
            self._ensure_initialised()
        except Exception:  # noqa: BLE001 - the first grammar request builds it again and reports it
            logger.exception("could not build the structured output backend")

    def _ensure_initialised(self) -> None:
        if self.initialised.is_set():
            return
        with self._init_lock:  # the one building it; the others wait here
            if not self.initialised.is_set():
                self._build()

    def _build(self) -> None:
        t0 = time.perf_counter()
        import llguidance.hf  # not llguidance.torch: it imports torch._dynamo and inductor (~4 s)

        lltok = llguidance.hf.from_tokenizer(
            self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
        )
        self._token_bytes = np.array(
            [0 if lltok.is_special_token(i) else len(lltok.decode_bytes([i])) for i in range(self.vocab_size)],
            dtype=np.int32,
        )
        self._lltok = lltok
        self.built_on = threading.current_thread().name
        self.initialised.set()
        logger.info("structured output backend ready in %.2f s", time.perf_counter() - t0)

    @property
    def lltokenizer(self) -> LLTokenizer:
        self._ensure_initialised()
        assert self._lltok is not None  # set by _build
        return self._lltok

    def matcher_for(self, params: GuidedDecodingParams) -> LLMatcher:
        """A fresh matcher for one request; ValueError if the grammar does not compile, or cannot be
        followed (_probe)."""
        from llguidance import LLMatcher

        grammar = params.to_grammar()
        lltok = self.lltokenizer  # outside self._lock: a build in progress must not block cached grammars
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                matcher = template.deep_copy()
        if template is not None:
            # Copies share their template's lexer: one that ran out of fuel at run time broke it for good.
            if _error_of(matcher, self.vocab_size) is None:
                return matcher
            with self._lock:
                if self._compiled.get(grammar) is template:
                    del self._compiled[grammar]
        template = LLMatcher(lltok, grammar)  # without the lock: it drops the GIL to compile
        error = _first_line(template.get_error()) if template.is_error() else self._probe(template)
        if error:
            raise ValueError(f"invalid guided decoding grammar: {error}")
        with self._lock:
            self._compiled[grammar] = template
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _probe(self, template: LLMatcher) -> str | None:
        """Why the grammar cannot be followed (None: it can, as far as the probe sees).

        llguidance builds its lexer lazily, so a grammar can compile and then exhaust the lexer's
        budget a few tokens in (`((a{1,1000}){1,1000}){1,1000}` after 24 bytes: "too many
        expressions constructed"); the matcher then allows only EOS and the output ends, not
        matching. So a new grammar is walked for up to PROBE_TOKENS tokens, taking the longest
        allowed token each time, the quickest way deep into its lexemes. The walk's lexer states stay
        with the template (later requests find them built); a grammar that fails it is not kept."""
        assert self._token_bytes is not None  # built with the backend
        matcher = template.deep_copy()
        mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        for _ in range(self.PROBE_TOKENS):
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # drops the GIL
            if matcher.is_error():
                return _first_line(matcher.get_error())
            if matcher.is_stopped():
                return None
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab_size]
            lengths = np.where(allowed.astype(bool), self._token_bytes, -1)
            token = int(lengths.argmax())
            if lengths[token] <= 0 or not matcher.consume_token(token):  # only EOS (or specials) from here
                return _first_line(matcher.get_error()) if matcher.is_error() else None
        return None

    def allows_only_eos(self, matcher: LLMatcher) -> bool:
        """True when the matcher's next token can only be EOS (the grammar accepts nothing more)."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        return set(allowed.tolist()) <= set(self.eos_token_ids)


def _error_of(matcher: LLMatcher, vocab_size: int) -> str | None:
    """The matcher's error once its first mask is computed (None: none)."""
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return _first_line(matcher.get_error()) if matcher.is_error() else None


def _first_line(error: str) -> str:
    """llguidance's error without the parser-state dump it appends."""
    return error.strip().split("\n", 1)[0]


def fill_bitmask(matcher: LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Fill row `row` of an int32 [R, W] CPU bitmask with the matcher's allowed tokens (bit b of word
    w: token 32 w + b). llguidance.torch's function does this, but importing that module imports
    torch._dynamo and inductor (its masking function is torch.compile'd): 4-5 s on the engine thread
    at the first grammar step, which stalled every stream."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())  # drops the GIL


def apply_grammar_masks(logits: torch.Tensor, matchers: Sequence[Any]) -> torch.Tensor | None:
    """matchers: an LLMatcher, a state with a fill_bitmask method (spec_decode's MatcherAt) or None
    per row. In place: mask the logits of every row whose matcher is not None to its allowed tokens,
    in one pass over those rows; returns those rows' [R, V] allowed mask (None when no row has a
    matcher). llguidance fills an int32 bitmask on the CPU; it goes to the logits' device in one
    copy and is unpacked there. Eager torch: llguidance's own apply_token_bitmask_inplace is
    torch.compile'd, and its first call (on the engine thread) compiled for 8-15 s; nor is its
    module imported (fill_bitmask says why)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    vocab, dev = logits.shape[1], logits.device
    # Pinned for a GPU: an async copy. -1: all allowed, for what a matcher leaves unwritten.
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=dev.type == "cuda")
    for k, i in enumerate(rows):
        fill_at = getattr(matchers[i], "fill_bitmask", None)  # a draft position's state (spec_decode)
        if fill_at is not None:
            fill_at(fill_bitmask, bitmask, k)
        else:
            fill_bitmask(matchers[i], bitmask, k)
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
