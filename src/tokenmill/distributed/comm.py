"""Collectives between tensor-parallel ranks on one machine.

A torch.distributed gloo process group (built on its own TCPStore, so it never touches the
process-wide default group) carries the set-up rendezvous. The all-reduce after each
row-parallel layer (two per decoder layer, every step) is the hot one, and the logits gather
runs once a step: by default both go through shared memory, because gloo's loopback TCP costs
from tens of microseconds to milliseconds per call on a busy machine (benchmarks/tensor_parallel.py
--parts allreduce; vLLM's and SGLang's CPU backends use shared memory too).
TOKENMILL_TP_ALLREDUCE=gloo switches both to gloo. On GPUs (each rank its own, cuda:rank) both
run on NCCL, on the tensors where they are, and the shared memory is not used.

Shared-memory all-reduce: each rank owns a slot per phase in one /dev/shm file. A rank copies
its partial sum into its slot, publishes the call's sequence number, waits until every rank has
published it, then sums all slots (in float32, in rank order: every rank gets the same bits)
into its own output. Two phases alternate, so a fast rank writing call k+1 never overwrites
call k's data that a slow rank is still reading: to get past call k+1's wait, every rank must
have finished call k. The C++ kernel (csrc/shm_allreduce.cpp: release / acquire atomics, GIL
released while it waits) runs it; without the kernels, the same protocol in torch and numpy,
whose flag stores follow data stores and flag loads precede data loads in program order, which
x86's memory model keeps (TSO).
"""

from __future__ import annotations

import datetime
import mmap
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from tokenmill import envs
from tokenmill.kernels import cpu_kernels

SPIN_BEFORE_YIELD_S = 50e-6  # then sched_yield: a rank may share its core with the rank it waits for
SPIN_NS = int(SPIN_BEFORE_YIELD_S * 1e9)
CHECK_ABORT_EVERY = 256  # yields between looks at the abort flag


class TPAborted(RuntimeError):
    """A collective gave up: another rank died or the engine is shutting down."""


class ShmAllReduce:
    HEADER = 64 * 8  # int64 words: [0] abort flag, [8 + phase * world + rank] sequence numbers

    def __init__(self, path: str, rank: int, world: int, capacity_bytes: int, create: bool):
        self.rank, self.world = rank, world
        self.capacity = capacity_bytes // 4  # float32 elements per slot
        size = self.HEADER + 2 * world * capacity_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._mm, dtype=np.int64, count=self.HEADER // 8)
        self.words_t = torch.frombuffer(self._mm, dtype=torch.int64, count=self.HEADER // 8)

        kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
        self.kernel = getattr(kernels, "shm_all_reduce", None)
        data = torch.frombuffer(self._mm, dtype=torch.float32, offset=self.HEADER, count=2 * world * self.capacity)
        self.slots = data.view(2, world, self.capacity)
        self.seq = 0

    def abort(self) -> None:
        self.words[0] = 1

    def _flag(self, phase: int, rank: int) -> int:
        return 8 + phase * self.world + rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (float32 accumulation); returns x."""
        flat = x.view(-1)
        for start in range(0, flat.numel(), self.capacity):
            part = flat[start : start + self.capacity]
            self.seq += 1
            if self.kernel is not None:
                if not self.kernel(part, self.slots, self.words_t, self.rank, self.world, self.seq, SPIN_NS):
                    raise TPAborted("tensor-parallel all-reduce aborted: a rank died or the engine stopped")
                continue
            phase, n = self.seq & 1, part.numel()
            slots = self.slots[phase, :, :n]
            slots[self.rank].copy_(part)
            self.words[self._flag(phase, self.rank)] = self.seq
            for r in range(self.world):
                if r != self.rank:
                    self._wait(self._flag(phase, r))
            part.copy_(slots.sum(0))
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """[R, C] float32 from every rank -> [R, world * C] on rank 0 (None elsewhere), through the
        slots in pieces of whole rows. Rank 0 publishes a piece's number only after reading it, and
        the others wait for that, so no slot is written again before rank 0 has read it."""
        R, C = x.shape
        if C > self.capacity:
            raise ValueError(f"a row of {C} values does not fit the all-reduce buffer ({self.capacity})")
        step = self.capacity // C
        out = torch.empty(R, self.world, C, dtype=x.dtype) if self.rank == 0 else None
        for r0 in range(0, R, step):
            part = x[r0 : r0 + step]
            self.seq += 1
            phase, n = self.seq & 1, part.numel()
            if self.rank == 0:
                for r in range(1, self.world):
                    self._wait(self._flag(phase, r))
                out[r0 : r0 + len(part), 0] = part
                out[r0 : r0 + len(part), 1:] = (
                    self.slots[phase, 1:, :n].view(self.world - 1, len(part), C).transpose(0, 1)
                )
                self.words[self._flag(phase, 0)] = self.seq
            else:
                self.slots[phase, self.rank, :n].copy_(part.reshape(-1))
                self.words[self._flag(phase, self.rank)] = self.seq
                self._wait(self._flag(phase, 0))
        return out.view(R, self.world * C) if out is not None else None

    def _wait(self, word: int) -> None:
        words, seq = self.words, self.seq
        if words[word] >= seq:
            return
        deadline = time.perf_counter() + SPIN_BEFORE_YIELD_S
        while words[word] < seq:
            if time.perf_counter() > deadline:
                break
        i = 0
        while words[word] < seq:
            os.sched_yield()
            i += 1
            if i % CHECK_ABORT_EVERY == 0:
                if words[0]:
                    raise TPAborted("tensor-parallel all-reduce aborted: a rank died or the engine stopped")
                if i > 100_000:  # past ~0.1 s of waiting: sleep instead of burning a core
                    time.sleep(0.0005)

    def close(self) -> None:
        self.words = self.words_t = self.slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it; the mapping goes with the process
            pass


def uses_nccl(device: str) -> bool:
    return torch.device(device).type == "cuda"


def rank_device(device: str, rank: int) -> str:
    """Each rank's device: its own GPU (cuda:rank), or the CPU."""
    return f"cuda:{rank}" if uses_nccl(device) else device


class TPGroup:
    """This process's rank in a tensor-parallel group: all_reduce (row-parallel layers) and
    gather_to_first (column-parallel logits). A group of one does nothing."""

    def __init__(self, rank: int = 0, size: int = 1, pg=None, shm: ShmAllReduce | None = None, nccl: bool = False):
        self.rank, self.size, self.pg, self.shm, self.nccl = rank, size, pg, shm, nccl

    @classmethod
    def connect(
        cls,
        rank: int,
        size: int,
        port: int,
        shm_path: str,
        shm_bytes: int,
        timeout_s: float = 300.0,
        device: str = "cpu",
    ) -> TPGroup:
        """Rank 0 hosts the store (and, on CPUs, creates the shared-memory file before calling this)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout, wait_for_workers=False)
        shm, nccl = None, uses_nccl(device)
        if nccl:
            torch.cuda.set_device(rank)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
            if envs.TOKENMILL_TP_ALLREDUCE != "gloo":
                shm = ShmAllReduce(shm_path, rank, size, shm_bytes, create=False)
        group = cls(rank, size, pg, shm, nccl)
        group._store = store  # the store must outlive the group
        return group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None:
            return self.shm.all_reduce(x)
        # NCCL sums in the activations' dtype on the GPU (as vLLM); gloo in float32 on the CPU.
        acc = x.float() if x.dtype != torch.float32 and not self.nccl else x
        self.pg.allreduce([acc]).wait()
        if acc is not x:
            x.copy_(acc)
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's value (ranks that size their KV cache apart agree on it)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=f"cuda:{self.rank}" if self.nccl else "cpu")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenates every rank's x [R, C] (float32) along the last dimension on rank 0; None elsewhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None:
            return self.shm.gather_to_first(x)
        if self.nccl:  # all-gather: NCCL's gather is a loop of sends; the logits are small
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.allgather([parts], [x]).wait()
            return torch.cat(parts, dim=-1) if self.rank == 0 else None
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.gather([parts], [x], dist.GatherOptions()).wait()
            return torch.cat(parts, dim=-1)
        self.pg.gather([], [x], dist.GatherOptions()).wait()
        return None

    def abort(self) -> None:
        if self.shm is not None:
            self.shm.abort()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
        self.pg = None


NO_TP = TPGroup()
