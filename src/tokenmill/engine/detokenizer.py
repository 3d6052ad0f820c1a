"""Incremental detokenization with stop strings.

Text is produced by `tokenizers`' DecodeStream, primed with the last prompt tokens so the
first output token gets the right leading space (SentencePiece) and multi-byte UTF-8 split
across tokens is held back until complete. Stop strings are matched in the accumulated text,
so a stop string spanning several tokens is found; it is never emitted, and streamed text
holds back the few characters that could still be the start of one.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_PRIME_TOKENS = 6  # enough prompt context for spacing rules of SentencePiece and BPE


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=list(prompt_token_ids[-_PRIME_TOKENS:]), skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already handed out as deltas
        self.stop_string: str | None = None

    def add_token(self, token_id: int) -> str | None:
        """Feed one generated token. Returns the stop string if this token completed one."""
        if self.stop_string is not None:
            return self.stop_string
        chunk = self.stream.step(self.tokenizer, token_id)
        if not chunk:
            return None
        start = max(0, len(self.text) - self.hold)
        self.text += chunk
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.text = self.text[: idx + len(s) if self.include_stop else idx]
                self.stop_string = s
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished or self.stop_string else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
