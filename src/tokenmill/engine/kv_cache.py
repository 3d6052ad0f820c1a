"""Paged KV memory: a pool of fixed-size blocks and the per-request block tables over it.

The pool is shaped for prefix caching: each block carries a ref count and an optional
content hash, and freed blocks go to the tail of an LRU free queue (they keep their hash
until reused), so cached blocks can be found again and evicted oldest-first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.engine.request import Request


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

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks that may sit in the free queue (a prefix-cache hit)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue's tail in the given
        order (callers pass a request's blocks tail-first, so its last blocks are evicted first)."""
        for b in blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"block {b.block_id} freed twice"
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - 1)


class KVCacheManager:
    """The scheduler's only view of KV memory: per-request block tables over a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the request's K/V up to num_computed_tokens + num_new_tokens.
        Returns False (and allocates nothing) when the pool cannot give that many blocks."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        blocks.extend(self.pool.get_new_blocks(need))
        return True

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def usage(self) -> float:
        return self.pool.usage()
