"""Paged KV memory: a pool of fixed-size blocks and the per-request block tables over it.

Automatic prefix caching (vLLM's design): every full block is named by a hash chained over
(parent block's hash, its token ids, extra keys), so equal hashes mean equal prefixes. Blocks
keep their hash after their request frees them and sit in an LRU free queue until a new
allocation evicts them; a later request whose prompt starts with the same blocks takes a
reference on them instead of recomputing.

Sliding windows: when every layer of the model attends only to its last W keys (Mistral-style
configs), a request's blocks wholly before the window of its next query are read by no layer
again. They go back to the pool as the request proceeds (its table keeps the null block in their
place, so positions stay where they were; no kernel reads a key before its window), still named by
their hash: their K/V is a function of the prefix their hash chains over, so a later request with
that prefix may take them again. A hit needs only the blocks its first query's window reads: the
longest prefix whose blocks from there on are all cached counts, the blocks before it become null
entries (vLLM's sliding-window manager). When some layer attends to every key (Gemma 2 / 3
interleave global layers with local ones) every block stays needed and nothing is freed early:
that would take a block table per group of layers (vLLM's hybrid allocator).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from tokenmill.request import Request


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """SHA-256 over the parent hash, the block's tokens and extra keys (LoRA, cache salt):
    a collision would serve one prompt another's K/V, so no weak hash."""
    h = hashlib.sha256(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"|" + extra)
    return h.digest()


def blocks_held(num_tokens: int, step_tokens: int, block_size: int, sliding_window: int | None) -> int:
    """The most KV blocks a request of num_tokens tokens holds at once when no step computes more
    than step_tokens of them: all its blocks, or where every layer slides a window of W keys, those
    of the W - 1 keys before a step's first query and of the step's own tokens, one more where they
    straddle a block boundary (the blocks before them are back in the pool: _free_skipped)."""
    every = -(-num_tokens // block_size)
    if sliding_window is None:
        return every
    return min(every, -(-(sliding_window - 1 + step_tokens) // block_size) + 1)


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens: what admitted requests asked for and what the cache served."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and hashed (prefix caching)


class BlockPool:
    """Owns every block. Block 0 is the null block: never handed out, used as padding."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # LRU free queue: left end is evicted first. Ordered dict gives O(1) removal from the
        # middle, which prefix caching needs when a cached free block is hit again.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on blocks that may sit in the free queue (a prefix-cache hit); null
        entries (blocks a sliding window skips) take none."""
        for b in blocks:
            if b is self.null_block:
                continue
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in the given
        order (callers pass a request's blocks tail-first, so its last blocks are evicted first)."""
        for b in blocks:
            if b is self.null_block:  # a table's placeholder for a block out of every window
                continue
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} freed twice"
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> int:
        """Forget every block's content hash (free blocks and blocks in use alike), so that no later
        request reuses K/V computed before now; blocks in use stay with their requests. Returns how
        many hashes were dropped."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return n

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Name a full block by its content; the first block with a given content stays the one."""
        if block is not self.null_block and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block


class KVCacheManager:
    """The scheduler's only view of KV memory: per-request block tables over a BlockPool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        """sliding_window: the window every layer's keys leave (attention.kv_window); None: some
        layer reads every key."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_skipped: dict[str, int] = {}  # leading blocks of a request out of every window (null now)
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.block_hashes: dict[str, list[bytes]] = {}  # per request, chained, one per full block
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """blocks_held for this pool's block size and window: what admission checks."""
        return blocks_held(num_tokens, step_tokens, self.block_size, self.sliding_window)

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chained block hashes, extended to cover its first num_blocks blocks."""
        hashes = self.block_hashes.setdefault(request.request_id, [])
        bs, toks = self.block_size, request.all_token_ids
        extra = request.cache_key
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, toks[i * bs : (i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that starts the request's tokens. The last token is
        never served from cache: the step needs its logits (nor any token, for a request that
        wants prompt logprobs; nor a pooling request's: it needs the hidden states of its tokens)."""
        if not self.enable_prefix_caching or request.prompt_logprobs is not None or request.pooling_params is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(self._hashes(request, max_blocks))
        hits = []
        for h in self._hashes(request, max_blocks):
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def skippable(self, first_pos: int) -> int:
        """How many leading blocks no query at first_pos or later reads (all of them before its window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (first_pos - self.sliding_window + 1) // self.block_size)

    def _window_hits(self, hashes: list[bytes]) -> list[KVBlock]:
        """The longest k whose blocks skippable(k * block_size) .. k - 1 are all cached (what a first
        query at k * block_size reads); those blocks, after null entries for the ones it skips."""
        found = [self.pool.cached.get(h) for h in hashes]
        misses = [0]  # misses[i]: uncached blocks among the first i
        for b in found:
            misses.append(misses[-1] + (b is None))
        for k in range(len(found), 0, -1):
            skip = self.skippable(k * self.block_size)
            if misses[k] == misses[skip]:
                # found[skip:k] holds no None (no misses among them)
                return [self.pool.null_block] * skip + cast("list[KVBlock]", found[skip:k])
        return []

    def _free_skipped(self, request_id: str, blocks: list[KVBlock], first_pos: int) -> None:
        """Return the request's blocks that left every layer's window (the next query is at
        first_pos) to the pool, tail first; the null block takes their places in its table."""
        done, n = self.num_skipped.get(request_id, 0), self.skippable(first_pos)
        if n <= done:
            return
        self.pool.free_blocks(list(reversed(blocks[done:n])))
        blocks[done:n] = [self.pool.null_block] * (n - done)
        self.num_skipped[request_id] = n

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: Sequence[KVBlock] = ()) -> bool:
        """Make room for the request's K/V up to num_computed_tokens + num_new_tokens, after the
        prefix-cache hits `computed` (which the caller counts as computed once this succeeds).
        Returns False (and allocates nothing) when the pool cannot give that many blocks."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if blocks:
            self._free_skipped(request.request_id, blocks, request.num_computed_tokens)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(computed)
        # Hits that sit in the free queue stop being free once taken.
        if max(need, 0) + sum(1 for b in computed if b.ref_cnt == 0) > self.pool.num_free_blocks:
            return False
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(blocks)
            self.num_skipped[request.request_id] = sum(b is self.pool.null_block for b in computed)
        if need > 0:
            blocks.extend(self.pool.get_new_blocks(need))
        return True

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_cached_tokens

    def cache_blocks(self, request: Request) -> None:
        """Hash the request's blocks that became full of computed K/V since the last call (not a
        pooling request's: an encoder keeps no K/V in them, and they are freed as soon as it pools)."""
        if not self.enable_prefix_caching or request.pooling_params is not None:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        blocks, hashes = self.req_blocks[rid], self._hashes(request, num_full)
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def reset_prefix_cache(self) -> int:
        """vLLM's reset_prefix_cache (POST /reset_prefix_cache): see BlockPool.reset_prefix_cache. A
        running request keeps the blocks it has; its blocks hashed so far stay unnamed (not hashed
        again), so they are freed as plain blocks. The hit counters are cumulative and stay."""
        return self.pool.reset_prefix_cache()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those num_tokens need (what rejected draft tokens used)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks and len(blocks) > keep:
            self.pool.free_blocks(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks (they stay cached until evicted). Its hashes are kept
        while the request lives on (a preempted request comes back with the same tokens)."""
        rid = request.request_id
        self.num_cached_blocks.pop(rid, None)
        self.num_skipped.pop(rid, None)
        blocks = self.req_blocks.pop(rid, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))
        if request.finished:
            self.block_hashes.pop(rid, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def usage(self) -> float:
        return self.pool.usage()
