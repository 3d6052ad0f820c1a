"""Routing requests to engine replicas: prefix-hash affinity with a least-loaded fallback.

A Ray Serve request router (`ray.serve.request_router.RequestRouter`) that lives in the
ingress process, next to the deployment handle. Each engine replica keeps its own prefix
cache, so a prompt is fastest on the replica that already computed its prefix. The router
remembers, for the chained hashes of each routed prompt's leading token blocks, which
replica it sent them to (an LRU table), and sends a new request to the replica holding its
longest matching prefix, unless that replica is busier than the least loaded one by more
than `imbalance_threshold` ongoing requests. With no match (or too much imbalance) the
request goes to the least loaded replica, ties broken by a hash of the prefix (rendezvous
hashing), and is remembered there. The samples of one `n > 1` request (one parent id) go
to one replica, so they share its prompt blocks.

Learned from Ray's own PrefixCacheAffinityRouter (ray.llm), which matches prompt text in a
prefix-tree actor; this one hashes token ids in the engine's block size, needs no extra actor
and never blocks the event loop.

Policies: "prefix" (above), "round_robin" (each request to the next replica in turn) and
"pow2" (Serve's default: the less loaded of two random replicas), for comparison.
"""

from __future__ import annotations

import itertools
import zlib
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

POLICIES = ("prefix", "round_robin", "pow2")
ROUTER_CLASS_PATH = "tokenmill.ray_serve.routing:TokenmillRouter"


def prefix_block_hashes(token_ids: list[int], block_size: int, max_blocks: int) -> list[int]:
    """Chained hashes of the full leading blocks of a prompt: hash i covers tokens [0, (i+1) * block_size).
    Ints and tuples of ints hash the same in every Python process (no hash randomisation)."""
    hashes: list[int] = []
    h = 0
    n = min(len(token_ids) // block_size, max_blocks)
    for i in range(n):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(h)
    return hashes


class PrefixTable:
    """Block hash -> the replica it was last routed to; least recently used entries go first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._table: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def remember(self, hashes: list[int], replica: str) -> None:
        table = self._table
        for h in hashes:
            table[h] = replica
            table.move_to_end(h)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def match(self, hashes: list[int], live: set[str]) -> tuple[str | None, int]:
        """The live replica holding the longest prefix of `hashes`, and how many blocks it holds."""
        best, depth = None, 0
        for i, h in enumerate(hashes):
            replica = self._table.get(h)
            if replica is None:
                break  # chained hashes: no longer prefix can be known either
            if replica in live:
                best, depth = replica, i + 1
        return best, depth

    def forget(self, replica: str) -> None:
        for h in [h for h, r in self._table.items() if r == replica]:
            del self._table[h]


def _request_prompt(pending: PendingRequest | None) -> tuple[list[int] | None, str | None]:
    """(prompt token ids, parent id) of an engine `generate` call; (None, None) for other methods."""
    if pending is None or not pending.args:
        return None, None
    ids = pending.args[0]
    if not isinstance(ids, list):
        return None, None
    parent = pending.args[3] if len(pending.args) > 3 and isinstance(pending.args[3], str) else None
    return ids, parent


class TokenmillRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """See the module docstring. Configured through `request_router_kwargs` (initialize_state)."""

    def initialize_state(
        self,
        policy: str = "prefix",
        block_size: int = 16,
        max_prefix_blocks: int = 256,
        min_match_blocks: int = 2,
        imbalance_threshold: int = 8,
        table_capacity: int = 200_000,
        **_: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.min_match_blocks = min_match_blocks
        self.imbalance_threshold = imbalance_threshold
        self.table = PrefixTable(table_capacity)
        self._parents: OrderedDict[str, str] = OrderedDict()  # parent id -> replica of its first sample
        self._ongoing: dict[str, int] = {}  # replica -> requests this router has in flight there
        self._routed: dict[str, str] = {}  # internal request id -> replica (to count completions)
        self._turn = itertools.count()

    # ---- Serve's hooks ----------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if self.policy == "pow2":
            from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        if self.policy == "round_robin":
            first = candidate_replicas[next(self._turn) % len(candidate_replicas)]
            return [[first], candidate_replicas]  # the others, should the chosen one be full
        return [[self._choose_prefix(candidate_replicas, pending_request)], self._by_load(candidate_replicas, 0)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        replica = replica_id.unique_id
        self._routed[pending_request.metadata.internal_request_id] = replica
        self._ongoing[replica] = self._ongoing.get(replica, 0) + 1
        if self.policy == "prefix":  # the replica that took it, which may not be the first choice
            ids, parent = _request_prompt(pending_request)
            if ids is not None:
                self.table.remember(prefix_block_hashes(ids, self.block_size, self.max_prefix_blocks), replica)
            if parent is not None:
                self._pin(parent, replica)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._routed.pop(internal_request_id, None)
        if replica is not None and self._ongoing.get(replica, 0) > 0:
            self._ongoing[replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)
        self._ongoing.pop(replica_id.unique_id, None)

    # ---- prefix affinity --------------------------------------------------------------------
    def load(self, replica: RunningReplica) -> int:
        """Ongoing requests: Serve's queue-length cache (what the replica last reported, plus what was
        sent since), else this router's own count."""
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else self._ongoing.get(replica.replica_id.unique_id, 0)

    def _by_load(self, candidates: list[RunningReplica], key: int) -> list[RunningReplica]:
        """Least loaded first; ties broken by rendezvous hashing on `key`, so that equal replicas
        split distinct prefixes evenly and every router agrees on the order."""
        return sorted(candidates, key=lambda r: (self.load(r), _rendezvous(key, r.replica_id.unique_id)))

    def _choose_prefix(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> RunningReplica:
        ids, parent = _request_prompt(pending)
        if ids is None:
            return self._by_load(candidates, 0)[0]
        by_id = {r.replica_id.unique_id: r for r in candidates}
        min_load = min(self.load(r) for r in candidates)
        if parent is not None and self._parents.get(parent) in by_id:
            return by_id[self._parents[parent]]  # siblings share the prompt's blocks on one replica
        hashes = prefix_block_hashes(ids, self.block_size, self.max_prefix_blocks)
        best, depth = self.table.match(hashes, set(by_id))
        if best is not None and depth >= min(self.min_match_blocks, len(hashes)):
            replica = by_id[best]
            if self.load(replica) - min_load <= self.imbalance_threshold:
                chosen = replica
            else:
                chosen = self._by_load(candidates, hashes[0])[0]
        else:
            chosen = self._by_load(candidates, hashes[0] if hashes else hash(tuple(ids)))[0]
        # Remembered now, not only once routed: the next request with this prefix may be routed
        # before this one is accepted (a burst), and must find it.
        self.table.remember(hashes, chosen.replica_id.unique_id)
        if parent is not None:
            self._pin(parent, chosen.replica_id.unique_id)
        return chosen

    def _pin(self, parent: str, replica: str) -> None:
        self._parents[parent] = replica
        self._parents.move_to_end(parent)
        while len(self._parents) > 10_000:
            self._parents.popitem(last=False)


def _rendezvous(key: int, replica: str) -> int:
    return zlib.crc32(f"{key}:{replica}".encode())
