"""Suffix decoding (arXiv 2411.04975; vLLM's `suffix` method, Arctic Inference's algorithm).

Two sources of drafts, each a depth-limited suffix tree with occurrence counts:
- the request's own tokens (prompt + output so far), and
- a global tree over the outputs of the last `max_cached_requests` finished requests (FIFO).
Each step, for every length m of the context's tail that occurs in a tree (m <= max_tree_depth - 1),
the draft walks from that match the most frequent continuation (ties: the smaller token id) while
the draft's estimated probability, the product of the per-step frequencies count(child) / count of
the node's continuations, stays >= min_token_prob, for at most min(k, int(max_spec_factor * m),
max_tree_depth - m) tokens. The draft with the highest score (the sum of those probabilities: the
expected number of accepted tokens) wins; on a tie the longer match, then the request's own tree.

The request's own tree is implicit: the counts a suffix trie would hold are those of a numpy scan
of its token array (ngram.suffix_match_ends), O(L) vectorised per step and nothing to build or
update, so 8k-token prompts cost no trie memory. The global tree is a real trie whose lone paths
(one occurrence) stay unexpanded, as a pointer into that output, until a second occurrence splits
them: memory grows with the tokens cached plus their repeats, not with tokens * depth.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenmill.spec_decode.ngram import TokenBuffer, suffix_match_ends

_PY_WALK = 16  # below this many occurrences the draft walk is plain Python (numpy's call cost dominates)


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0  # sum of the tokens' estimated probabilities
    match_len: int = 0
    source: str = ""  # "request" | "global" | "" (none)


class _Node:
    """count: occurrences of the path from the root; total: how many of them continue (the sum of the
    children's counts). A lone node (seq set) has count 1 and stands for the implicit chain
    seq[pos], seq[pos + 1], ... below it: the continuation of its one occurrence."""

    __slots__ = ("children", "count", "pos", "seq", "total")

    def __init__(self, seq: array | None = None, pos: int = 0):
        self.count = 1
        self.total = 0
        self.children: dict[int, _Node] | None = None
        self.seq = seq
        self.pos = pos


class _GlobalTree:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.root.count = 0
        self.root.children = {}

    def add(self, seq: array, start: int = 0, stop: int | None = None) -> None:
        """Insert the suffixes of seq starting at start..stop-1 (each one occurrence)."""
        for s in range(start, len(seq) if stop is None else stop):
            self._add_suffix(seq, s)

    def remove(self, seq: array, start: int = 0, stop: int | None = None) -> None:
        for s in range(start, len(seq) if stop is None else stop):
            self._remove_suffix(seq, s)

    def _add_suffix(self, seq: array, s: int) -> None:
        node = self.root
        for i in range(s, min(len(seq), s + self.depth)):
            tok = seq[i]
            if node.children is None:
                node.children = {}
            child = node.children.get(tok)
            node.total += 1
            if child is None:
                node.children[tok] = _Node(seq, i + 1)
                return
            child.count += 1
            if child.seq is not None:  # a second occurrence: the lone one moves one level down
                old, pos = child.seq, child.pos
                child.seq = None
                if pos < len(old) and i - s + 1 < self.depth:
                    child.children = {old[pos]: _Node(old, pos + 1)}
                    child.total = 1
            node = child

    def _remove_suffix(self, seq: array, s: int) -> None:
        node = self.root
        for i in range(s, min(len(seq), s + self.depth)):
            tok = seq[i]
            child = node.children[tok]
            node.total -= 1
            child.count -= 1
            if child.count == 0:  # its subtree held this occurrence alone
                del node.children[tok]
                return
            node = child

    def match(self, pattern: Sequence[int]) -> tuple[_Node, int, int] | None:
        """Walk pattern from the root: (node, tokens walked into its lone chain, depth), or None."""
        node, extra, depth = self.root, 0, 0
        for tok in pattern:
            if node.seq is not None:
                p = node.pos + extra
                if depth >= self.depth or p >= len(node.seq) or node.seq[p] != tok:
                    return None
                extra += 1
            else:
                child = node.children.get(tok) if node.children else None
                if child is None:
                    return None
                node = child
            depth += 1
        return node, extra, depth

    def draft(self, state: tuple[_Node, int, int], cap: int, min_prob: float) -> tuple[list[int], float]:
        node, extra, depth = state
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < cap and depth < self.depth:
            if node.seq is not None:  # one occurrence: its next token, with probability 1
                at = node.pos + extra
                if at >= len(node.seq):
                    break
                tok = node.seq[at]
                extra += 1
            else:
                if not node.total:
                    break
                tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
                p = prob * (child.count / node.total)
                if p < min_prob:
                    break
                prob = p
                node, extra = child, 0
            out.append(tok)
            score += prob
            depth += 1
        return out, score


def _draft_local(tokens: np.ndarray, ends: np.ndarray, cap: int, min_prob: float) -> tuple[list[int], float]:
    """The walk of _GlobalTree.draft over the request's own tokens: occ holds the positions of
    the next token after each occurrence of the path so far."""
    L = tokens.shape[0]
    occ = ends + 1
    out: list[int] = []
    prob, score = 1.0, 0.0
    while len(out) < cap and occ.size > _PY_WALK:
        occ = occ[occ < L]
        if not occ.size:
            return out, score
        nxt = tokens[occ]
        vals, counts = np.unique(nxt, return_counts=True)
        i = int(counts.argmax())  # the first maximum: the smallest token id
        p = prob * (int(counts[i]) / occ.size)
        if p < min_prob:
            return out, score
        tok = int(vals[i])
        prob = p
        out.append(tok)
        score += prob
        occ = occ[nxt == tok] + 1
    pos = occ.tolist()
    while len(out) < cap:
        pos = [p for p in pos if p < L]
        if not pos:
            break
        freq: dict[int, int] = {}
        for p in pos:
            t = int(tokens[p])
            freq[t] = freq.get(t, 0) + 1
        tok, cnt = max(freq.items(), key=lambda kv: (kv[1], -kv[0]))
        p = prob * (cnt / len(pos))
        if p < min_prob:
            break
        prob = p
        out.append(tok)
        score += prob
        pos = [p + 1 for p in pos if tokens[p] == tok]
    return out, score


@dataclass
class _Cached:
    seq: array  # a finished request's output
    inserted: int = 0  # its suffixes 0..inserted-1 are in the global tree
    evicted: bool = False


class SuffixProposer:
    """Per-request contexts plus the global cache of finished outputs. Not thread-safe: call it from
    the engine's step loop.

    insert_budget: a finished output enters the global tree a few suffixes at a time, at most this
    many per propose() call (a 512-token output costs 3-13 ms of Python in one go, a hiccup in the
    step loop); None inserts it whole in finish_request, 0 only in explicit flush() calls."""

    def __init__(
        self,
        k: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        insert_budget: int | None = 32,
    ):
        if k < 1 or max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError("need k >= 1, max_tree_depth >= 1, max_cached_requests >= 0")
        self.k, self.depth = k, max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.insert_budget = insert_budget
        self._requests: dict[str, tuple[TokenBuffer, int]] = {}  # id -> (prompt + output, prompt length)
        self._global = _GlobalTree(max_tree_depth)
        self._cached: deque[_Cached] = deque()  # oldest first
        self._pending: deque[_Cached] = deque()  # not yet fully inserted, oldest first

    @classmethod
    def from_config(cls, cfg, **kwargs) -> SuffixProposer:
        """From a SpeculativeConfig (method "suffix"); kwargs: insert_budget."""
        return cls(
            cfg.num_speculative_tokens,
            cfg.suffix_decoding_max_tree_depth,
            cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor,
            cfg.suffix_decoding_min_token_prob,
            **kwargs,
        )

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def start_request(self, request_id: str, prompt_token_ids: Sequence[int] | np.ndarray) -> None:
        self._requests[request_id] = (TokenBuffer(prompt_token_ids), len(prompt_token_ids))

    def add_tokens(self, request_id: str, new_tokens: Sequence[int] | np.ndarray) -> None:
        """Append the tokens this step accepted (verified drafts + the sampled one). A request not
        started yet is ignored: its first propose() with token_ids starts it."""
        entry = self._requests.get(request_id)
        if entry is not None:
            entry[0].extend(new_tokens)

    def finish_request(self, request_id: str, cache: bool = True) -> None:
        """Drop the request; with cache (a normal finish, not an abort) its output joins the global
        tree, evicting the oldest cached outputs past max_cached_requests."""
        entry = self._requests.pop(request_id, None)
        if entry is None or not cache or self.max_cached_requests == 0:
            return
        buf, prompt_len = entry
        out = array("i", buf.view()[prompt_len:].tobytes())
        if not out:
            return
        cached = _Cached(out)
        self._cached.append(cached)
        self._pending.append(cached)
        while len(self._cached) > self.max_cached_requests:
            old = self._cached.popleft()
            self._global.remove(old.seq, 0, old.inserted)
            old.evicted = True
        if self.insert_budget is None:
            self.flush()

    def flush(self, budget: int | None = None) -> None:
        """Insert pending cached outputs into the global tree: all, or up to budget suffixes."""
        while self._pending and (budget is None or budget > 0):
            e = self._pending[0]
            left = 0 if e.evicted else len(e.seq) - e.inserted
            n = left if budget is None else min(left, budget)
            self._global.add(e.seq, e.inserted, e.inserted + n)
            e.inserted += n
            if budget is not None:
                budget -= n
            if n == left:
                self._pending.popleft()

    def propose(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray | None = None,
        k: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> list[int]:
        """Up to k (default self.k) draft tokens for the request. token_ids, if given, is its full
        context (prompt + output): the stored one is brought in line with it (the new tail appended),
        so a caller may skip add_tokens. An unknown request_id starts with it, its first
        num_prompt_tokens (default: all) being the prompt, which finish_request does not cache."""
        return self.speculate(request_id, token_ids, k, num_prompt_tokens).token_ids

    def speculate(
        self,
        request_id: str,
        token_ids: Sequence[int] | np.ndarray | None = None,
        k: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> SuffixDraft:
        """propose(), with the draft's score, match length and source."""
        if request_id not in self._requests:
            ctx = () if token_ids is None else token_ids
            self.start_request(request_id, ctx)
            if num_prompt_tokens is not None:
                self._requests[request_id] = (self._requests[request_id][0], min(num_prompt_tokens, len(ctx)))
        buf = self._requests[request_id][0]
        if token_ids is not None and len(token_ids) != len(buf):
            if len(token_ids) < len(buf):
                buf.truncate(len(token_ids))
            else:
                buf.extend(token_ids[len(buf) :])
        if self._pending and self.insert_budget:
            self.flush(self.insert_budget)
        k = self.k if k is None else k
        tokens = buf.view()
        best = SuffixDraft()
        if k <= 0 or len(tokens) == 0:
            return best
        caps = [min(k, int(self.max_spec_factor * m), self.depth - m) for m in range(self.depth)]
        # Global tree: tails of length 1, 2, ... until one is absent (then every longer one is too).
        tail = tokens[-(self.depth - 1) :].tolist() if self.depth > 1 else []
        states = []
        for m in range(1, len(tail) + 1):
            st = self._global.match(tail[-m:])
            if st is None:
                break
            states.append(st)
        for m in range(len(states), 0, -1):  # longest first: a draft scores at most its length
            if caps[m] <= best.score or caps[m] <= 0:
                continue
            draft, score = self._global.draft(states[m - 1], caps[m], self.min_token_prob)
            if draft and score > best.score:
                best = SuffixDraft(draft, score, m, "global")
        levels = suffix_match_ends(tokens, self.depth - 1)
        for m in range(len(levels), 0, -1):
            if caps[m] <= 0 or caps[m] < best.score or (caps[m] == best.score and m < best.match_len):
                continue
            draft, score = _draft_local(tokens, levels[m - 1], caps[m], self.min_token_prob)
            if draft and (score > best.score or (score == best.score and m >= best.match_len)):
                best = SuffixDraft(draft, score, m, "request")
        return best
