"""N-gram (prompt lookup) drafts: continue the context the way an earlier copy of its tail went on.

The rule is vLLM's (v1 NgramProposer): the longest n in [min_n, max_n] such that the context's
last n tokens occur earlier in the context (prompt + output so far), and of that n-gram's
occurrences the *earliest* one; the draft is the up to k tokens that followed it. An occurrence
may overlap the tail itself (in "a a a a" the 3-gram "a a a" at 0 is followed by "a"); it only
has to end before the last token, so that at least one token follows it.

Vectorised with numpy: one O(L) comparison of every position with the last token, then each
longer n only filters the surviving candidates (a handful past n = 2), so an 8k-token context
costs tens of microseconds, not the O(L * n) of a Python scan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D integer array (no copy when already one)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr


class TokenBuffer:
    """A request's tokens as an append-only int32 array (capacity doubles), so that proposing
    each step reads a numpy view instead of converting an 8k-token Python list (~180 us)."""

    def __init__(self, tokens: Sequence[int] | np.ndarray = ()):
        self._buf = np.empty(max(16, len(tokens) * 2), dtype=np.int32)
        self._n = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._n

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        n = len(tokens)
        if self._n + n > self._buf.shape[0]:
            grown = np.empty(max(2 * self._buf.shape[0], self._n + n), dtype=np.int32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : self._n + n] = tokens
        self._n += n

    def truncate(self, n: int) -> None:
        self._n = min(self._n, max(0, n))

    def view(self) -> np.ndarray:
        """The tokens so far (a view: valid until the next extend)."""
        return self._buf[: self._n]


def suffix_match_ends(tokens: np.ndarray, max_n: int) -> list[np.ndarray]:
    """levels[m - 1] = the end positions e (ascending, e <= L - 2) where tokens[e-m+1 : e+1]
    equals the context's last m tokens, for m = 1, 2, ... until no earlier occurrence is left
    or m reaches max_n. Each level is a subset of the one before (a longer match ends at a
    position a shorter one also ends at), so level m+1 filters level m with one comparison."""
    L = int(tokens.shape[0])
    levels: list[np.ndarray] = []
    if L < 2 or max_n < 1:
        return levels
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    m = 1
    while ends.size:
        levels.append(ends)
        if m >= max_n or m >= L - 1:
            break
        ends = ends[ends >= m]  # room for m more tokens before the end position
        ends = ends[tokens[ends - m] == tokens[L - 1 - m]]
        m += 1
    return levels


class NgramProposer:
    """Prompt-lookup drafts for one request's context. Stateless: safe to share across requests."""

    def __init__(self, k: int, min_n: int, max_n: int):
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to k (default: self.k) draft tokens for the context token_ids (prompt + output);
        [] when no n-gram of length >= min_n recurs. Fewer than k when the matched occurrence
        is followed by fewer tokens. The caller caps k by what max_model_len leaves."""
        k = self.k if k is None else k
        if k <= 0:
            return []
        tokens = as_token_array(token_ids)
        levels = suffix_match_ends(tokens, self.max_n)
        if len(levels) < self.min_n:
            return []
        start = int(levels[-1][0]) + 1  # earliest occurrence of the longest match; drafts follow it
        return tokens[start : start + k].tolist()
