"""Tensor-parallel workers: one spawned process per rank beyond the engine's own (rank 0).

Rank 0 (the engine process) schedules and samples; each step it sends every worker the step's
inputs in one message over a pipe (pickled, tensors as numpy arrays), and all ranks run the
same forward pass, meeting at the all-reduces (comm.py). Workers cannot outlive the engine:
they are daemonic, ask the kernel for SIGKILL when their parent dies (PR_SET_PDEATHSIG), and
`stop()` ends them. A worker that dies makes the engine fail loudly: a monitor thread sees its
exit, aborts any collective in flight, and the next (or current) step raises TPWorkerDied.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch

from tokenmill import envs
from tokenmill.config import ModelConfig
from tokenmill.distributed.comm import ShmAllReduce, TPAborted, TPGroup, rank_device, uses_nccl
from tokenmill.kernels import cpu_threads
from tokenmill.worker.staging import StepInputs


class StepRunner(Protocol):
    """What a rank runs: the model runner, as the executor sees it."""

    def to_device(self, step: StepInputs) -> StepInputs: ...

    def run(self, step: StepInputs) -> Any: ...


logger = logging.getLogger("tokenmill")

POLL_AFTER_STEP_S = envs.TOKENMILL_TP_POLL_US / 1e6
READY_TIMEOUT_S = 900.0  # a worker loading a large shard (or compiling the kernels) takes minutes
# The CPUs this process may use, read before any engine pins its thread to rank 0's cores.
_PROCESS_CPUS = sorted(os.sched_getaffinity(0))


class TPWorkerDied(RuntimeError):
    pass


@dataclass
class WorkerSpec:
    """What a worker needs to build its shard of the model."""

    rank: int
    size: int
    port: int
    shm_path: str
    shm_bytes: int
    cores: list[int]
    model_config: ModelConfig  # this rank's (its device)
    # Builds this rank's runner from (model_config, tp=group): handed in by whoever starts the
    # workers, so that the executor does not depend on which runner it runs.
    build_runner: Callable[..., StepRunner]


def plan_cores(size: int, num_threads: int | None) -> tuple[int, list[list[int]]]:
    """Threads per rank and each rank's cores: consecutive, not overlapping while they fit
    (then they wrap around, with a warning)."""
    cpus = _PROCESS_CPUS
    threads = num_threads or max(1, min(len(cpus), cpu_threads.available_cpus(affinity=len(cpus))) // size)
    if threads * size > len(cpus):
        logger.warning(
            "tensor parallel: %d ranks x %d threads > %d CPUs available: ranks share cores, which "
            "slows every all-reduce",
            size,
            threads,
            len(cpus),
        )
    return threads, [[cpus[(r * threads + i) % len(cpus)] for i in range(threads)] for r in range(size)]


class _TensorPickler(pickle.Pickler):
    """Step inputs as numpy arrays: torch's own tensor pickling goes through torch.save (slow)."""

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, torch.Tensor):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


def dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _TensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class TPWorkers:
    """Rank 0's side: starts ranks 1..N-1, connects rank 0's group, broadcasts steps."""

    def __init__(
        self,
        size: int,
        num_threads: int | None,
        model_config: ModelConfig,
        build_runner: Callable[..., StepRunner],
        shm_bytes: int,
    ) -> None:
        self.size = size
        self.threads, self.cores = plan_cores(size, num_threads)
        fd, self.shm_path = tempfile.mkstemp(
            prefix="tokenmill-tp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        os.close(fd)
        if not uses_nccl(model_config.device):
            ShmAllReduce(self.shm_path, 0, size, shm_bytes, create=True).close()  # sized and zeroed
        port = _free_port()
        ctx = mp.get_context("spawn")  # fork would copy the engine's threads and locks
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            spec = WorkerSpec(
                rank,
                size,
                port,
                self.shm_path,
                shm_bytes,
                self.cores[rank],
                dataclasses.replace(model_config, device=rank_device(model_config.device, rank)),
                build_runner,
            )
            p = ctx.Process(
                target=_worker_entry, args=(spec, child, os.getpid()), daemon=True, name=f"tokenmill-tp{rank}"
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._stopping = False
        self.dead: str | None = None
        self._saved = (torch.get_num_threads(), os.sched_getaffinity(0))
        torch.set_num_threads(self.threads)  # rank 0: this process's compute runs on its own cores
        os.sched_setaffinity(0, self.cores[0])  # this thread (the engine's); its OpenMP team follows
        logger.info(
            "tensor parallel: %d ranks x %d threads; cores %s; worker pids %s",
            size,
            self.threads,
            self.cores,
            [p.pid for p in self.procs],
        )
        self.group = TPGroup.connect(0, size, port, self.shm_path, shm_bytes, device=model_config.device)
        self._monitor = threading.Thread(target=self._watch, name="tokenmill-tp-monitor", daemon=True)
        self._monitor.start()
        self._finalizer = weakref.finalize(self, _cleanup, self.procs, self.conns, self.shm_path)

    def wait_ready(self) -> None:
        """Blocks until every worker has loaded its shard; raises with a worker's error."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(READY_TIMEOUT_S):
                raise TPWorkerDied(f"tensor-parallel rank {rank} did not load its shard in {READY_TIMEOUT_S:.0f} s")
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                kind, detail = "error", f"exited with code {self.procs[rank - 1].exitcode}"
            if kind != "ready":
                self.stop()
                raise TPWorkerDied(f"tensor-parallel rank {rank} failed to start: {detail}")

    def broadcast(self, step: StepInputs) -> None:
        if self.dead:
            raise TPWorkerDied(self.dead)
        msg = dumps(step)
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except OSError as e:  # its pipe broke: it died (maybe before the monitor saw it)
            raise TPWorkerDied(self._death() or f"a tensor-parallel worker is gone: {e}") from e

    def check(self, err: BaseException) -> BaseException:
        """The error to raise for a failed collective: the worker's death when that is the cause."""
        if isinstance(err, TPAborted) or self.dead:
            return TPWorkerDied(self._death() or str(err))
        return err

    def _death(self, wait_s: float = 5.0) -> str | None:
        """Which worker died, in words (waiting up to wait_s for the dead one to be reaped)."""
        deadline = time.monotonic() + wait_s
        while not self.dead:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive():  # reaps it, setting exitcode
                    return (
                        f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}; "
                        f"the engine cannot continue"
                    )
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.dead

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        mp.connection.wait(sentinels)
        if self._stopping:
            return
        self.dead = self._death(wait_s=0.1) or "a tensor-parallel worker died; the engine cannot continue"
        logger.error(self.dead)
        self.group.abort()

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for conn in self.conns:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        self.group.abort()  # a worker blocked in a collective gives up
        self._finalizer()
        threads, cpus = self._saved
        torch.set_num_threads(threads)
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass


def _cleanup(procs: list[BaseProcess], conns: list[Connection], shm_path: str) -> None:
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for conn in conns:
        conn.close()
    try:
        os.unlink(shm_path)
    except OSError:
        pass


def _worker_entry(spec: WorkerSpec, conn: Connection, parent_pid: int) -> None:
    """Runs in the spawned process: pin, connect, load the shard, then run steps until told to stop."""
    _die_with_parent(parent_pid)
    os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(len(spec.cores))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{spec.rank}: %(message)s")
    try:
        group = TPGroup.connect(
            spec.rank, spec.size, spec.port, spec.shm_path, spec.shm_bytes, device=spec.model_config.device
        )
        runner = spec.build_runner(spec.model_config, tp=group)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e
    conn.send(("ready", None))
    while True:
        try:
            _await_message(conn)
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            break  # rank 0 is gone
        if msg == b"stop":
            break
        try:
            runner.run(runner.to_device(pickle.loads(msg)))
        except TPAborted:
            break
        except BaseException:  # noqa: BLE001 - rank 0 sees this process exit and fails loudly
            logging.getLogger("tokenmill").exception("tensor-parallel rank %d failed a step", spec.rank)
            group.abort()
            raise SystemExit(1) from None
    group.close()


def _await_message(conn: Connection) -> None:
    """Polls for the next step for POLL_AFTER_STEP_S (steps come back to back while requests run:
    a blocking read would add a wake-up to every step), then blocks in recv."""
    deadline = time.perf_counter() + POLL_AFTER_STEP_S
    while time.perf_counter() < deadline:
        if conn.poll(0):
            return
        os.sched_yield()  # a rank sharing its core lets the other run


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the engine process dies, however it dies (Linux)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
