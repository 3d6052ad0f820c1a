"""AsyncLLMEngine: an asyncio front over an LLMEngine stepping in a thread of its own.

The engine thread owns the LLMEngine: every add, abort and step happens there, so the
scheduler, block pool and tokenizer are never touched from two threads. `from_args` also
builds the engine there, so that it is the process's only thread that ever runs a torch
op: each thread that starts OpenMP work gets a pool of workers of its own, and once a
process has more OpenMP workers than cores, libgomp cuts its barrier spinning to ~100
iterations, so the engine's workers go to sleep and are woken (a futex round trip) at each of
the few hundred parallel ops of a step. Building the model on the main thread and stepping
it on this one cost a third of the throughput on 2 cores (347 -> 228 output tok/s offline,
the engine's OpenMP worker busy 65% instead of 99%). Callers talk to it
through an inbox; each request gets an asyncio queue that the engine thread fills with
`loop.call_soon_threadsafe`. A caller that stops iterating (a client disconnect) aborts its
request, which frees its KV blocks at the next step.

Requests are prepared (tokenized, bad words tokenized, grammars compiled, validated) on a small
worker pool, `prep_pool`, never on the engine thread: a request with 20,000 bad words must not
stall every other stream for the seconds its tokenization takes. The server runs its own
tokenization and chat-template rendering on the same pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tokenmill.config import DEFAULT_SERVING_ITL_TARGET_MS
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill")


# What a client is told: the cause is in the server's log ("engine loop died", with its traceback), not
# in an API's error body, which must not carry the server's internals.
ENGINE_DEAD = "the engine is not running (its error is in the server log)"


class EngineDeadError(RuntimeError):
    pass


T = TypeVar("T")
_Out = TypeVar("_Out", RequestOutput, PoolingRequestOutput)


@dataclass
class _Stream(Generic[_Out]):
    """One request's outputs (or the error that ends them), filled from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Out | BaseException]

    def put(self, item: _Out | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting: int | None = None) -> None:
        """`engine`: an LLMEngine, or a function that builds one (run on the engine thread;
        preferred, see the module's docstring). Construction errors are raised here."""
        self.engine: LLMEngine = None  # type: ignore[assignment]  # set on the engine thread
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()  # (kind, *arguments)
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream[Any]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._error: BaseException | None = None
        # Observers called from the engine thread after each step (metrics).
        self.step_observers: list[Callable[[list[RequestOutput | PoolingRequestOutput], float], None]] = []
        self.prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-prep")
        self._ready = threading.Event()
        build = (lambda: engine) if isinstance(engine, LLMEngine) else engine
        self._thread = threading.Thread(target=self._run, args=(build,), name="tokenmill-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self.engine is None:  # the build failed: _run kept its error
            raise self._error

    @classmethod
    def from_args(cls, model: str | None = None, max_waiting: int | None = None, **kw: Any) -> AsyncLLMEngine:
        if kw.get("itl_target_ms") is None:  # a server: requests stream beside each other
            kw["itl_target_ms"] = DEFAULT_SERVING_ITL_TARGET_MS
        return cls(lambda: LLMEngine.from_args(model, **kw), max_waiting)

    # ---- public API (event loop side) --------------------------------------------------
    @property
    def tokenizer(self) -> Any:  # the engine's Hugging Face tokenizer
        return self.engine.tokenizer

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped, if it died."""
        return self._error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        parent_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs (with delta_text) until the request finishes. `lora_request`: a
        LoRARequest (with --enable-lora; None: the base model), loaded on the prep pool; `priority`
        and `cache_salt`: see LLMEngine.make_request.
        Raises ValueError for bad input (or a request id already in flight), before the first output
        (lora.adapter.LoRAError, a ValueError, for an adapter that cannot serve)."""
        if not self.is_running:
            raise EngineDeadError(ENGINE_DEAD)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:  # a second stream under one id would take the first one's tokens
            raise ValueError(f"request id {rid!r} is already in use")
        loop = asyncio.get_running_loop()
        stream: _Stream[RequestOutput] = _Stream(loop, asyncio.Queue())
        self._streams[rid] = stream
        finished = True  # nothing to abort until the request is queued
        try:
            req = await loop.run_in_executor(
                self.prep_pool,
                functools.partial(
                    self.engine.make_request,
                    prompt,
                    params,
                    rid,
                    parent_id,
                    lora_request,
                    priority=priority,
                    cache_salt=cache_salt,
                ),
            )
            self._inbox.put(("add", req))
            self._wakeup.set()
            finished = False
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def encode(
        self, prompts: list[str | list[int]], params: PoolingParams | None = None, request_id: str | None = None
    ) -> list[PoolingRequestOutput]:
        """Embeddings of prompts (--task embed engines), in order: one engine request each
        (`{request_id}-{i}`), prepared together on the prep pool and queued together, so that one step
        can take them all. Raises ValueError for bad input before anything is queued (QueueFullError
        when the queue is full); cancelling aborts what is still running."""
        if not self.is_running:
            raise EngineDeadError(ENGINE_DEAD)
        base = request_id or f"embd-{next(self._ids)}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        if any(rid in self._streams for rid in rids):
            raise ValueError(f"request id {base!r} is already in use")
        loop = asyncio.get_running_loop()
        streams: dict[str, _Stream[PoolingRequestOutput]] = {rid: _Stream(loop, asyncio.Queue()) for rid in rids}
        self._streams.update(streams)
        pending: set[str] = set()
        try:
            reqs = await loop.run_in_executor(
                self.prep_pool, lambda: [self.engine.make_pooling_request(p, params, r) for p, r in zip(prompts, rids)]
            )
            self._inbox.put(("add", reqs))
            self._wakeup.set()
            pending = set(rids)
            outs = []
            for rid in rids:
                item = await streams[rid].queue.get()
                pending.discard(rid)
                if isinstance(item, BaseException):
                    raise item
                outs.append(item)
            return outs
        finally:
            for rid in rids:
                self._streams.pop(rid, None)
            for rid in pending:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    async def reset_prefix_cache(self) -> int:
        """LLMEngine.reset_prefix_cache, on the engine thread (which owns the block pool)."""
        if not self.is_running:
            raise EngineDeadError(ENGINE_DEAD)
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def abort_all(self, error: BaseException) -> None:
        """Abort every request in flight; each stream ends with `error` (e.g. the drain timeout)."""
        self._inbox.put(("abort_all", error))
        self._wakeup.set()

    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run fn(engine) on the engine thread (e.g. to read stats consistently)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._inbox.put(("call", fn, loop, fut))
        self._wakeup.set()
        return fut

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)
        self.prep_pool.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread -----------------------------------------------------------------
    def _run(self, build: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # noqa: BLE001 - raised again by __init__
            self._error = e
            return
        finally:
            self._ready.set()
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._wakeup.wait(0.5)
                    self._wakeup.clear()
                    engine.check_health()  # idle too: a dead tensor-parallel worker ends the loop
                    continue
                t0 = time.monotonic()
                outputs = engine.step()
                dt = time.monotonic() - t0
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                for obs in self.step_observers:
                    obs(outputs, dt)
        except BaseException as e:  # noqa: BLE001 - report to every waiter, never hang them
            logger.exception("engine loop died")
            self._error = e
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(ENGINE_DEAD))
        finally:
            engine.shutdown()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = msg[0]
            if kind == "add":  # one request, or the list of one embeddings call (admitted together)
                reqs = msg[1] if isinstance(msg[1], list) else [msg[1]]
                reqs = [r for r in reqs if r.request_id in self._streams]  # not those whose caller went away
                if not reqs:
                    continue
                queued = []
                try:
                    if self.max_waiting is not None and len(self.engine.core.scheduler.waiting) >= self.max_waiting:
                        raise QueueFullError(f"too many waiting requests (max {self.max_waiting}); retry later")
                    for req in reqs:
                        queued.append(self.engine.enqueue(req))
                    continue
                except (ValueError, QueueFullError) as e:
                    error = e
                except Exception as e:  # noqa: BLE001 - a bad request must not kill the engine loop
                    logger.exception("could not add request %s", reqs[0].request_id)
                    error = ValueError(f"invalid request: {e}")
                for rid in queued:  # all or nothing
                    self.engine.abort_request(rid)
                for stream in filter(None, map(self._streams.get, (r.request_id for r in reqs))):
                    stream.put(error)
            elif kind == "abort":
                out = self.engine.abort_request(msg[1])
                if out is not None:
                    logger.debug("aborted %s", msg[1])
            elif kind == "abort_all":
                for rid, stream in list(self._streams.items()):
                    self.engine.abort_request(rid)
                    stream.put(msg[1])
            elif kind == "call":
                _, fn, loop, fut = msg
                try:
                    res = fn(self.engine)
                    loop.call_soon_threadsafe(_set_result, fut, res, None)
                except Exception as e:  # noqa: BLE001
                    loop.call_soon_threadsafe(_set_result, fut, None, e)


class QueueFullError(RuntimeError):
    pass


class ServerShutdownError(RuntimeError):
    """Ends the streams still in flight when a server's drain timeout expires."""


def _set_result(fut: asyncio.Future[T], res: T, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)
