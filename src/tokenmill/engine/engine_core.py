"""EngineCore: schedule, run, update. The same core serves the offline API and the server."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.distributed.comm import NO_TP
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv_cache import KVCacheManager
from tokenmill.model.layers.attention import kv_window
from tokenmill.request import Request, RequestStatus
from tokenmill.sample.sampler import SampleLogprobs
from tokenmill.spec_decode.drafter import Drafter
from tokenmill.worker.executor import TPWorkers
from tokenmill.worker.runner import ModelRunner

logger = logging.getLogger("tokenmill")


@dataclass
class CoreOutput:
    """What one step did to one request: its new tokens (none, one, or with speculative decoding
    a verified run), their logprobs, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    finished: bool


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        cache = config.cache
        workers = _start_tp_workers(config) if config.parallel.tensor_parallel_size > 1 else None
        try:
            self.runner = ModelRunner(
                config.model,
                cache.num_blocks,
                cache.block_size,
                config.seed,
                config.watermark,
                workers.group if workers else NO_TP,
                workers,
                config.device,
                config.scheduler,
                config.lora,
            )
            if workers is not None:
                workers.wait_ready()
        except BaseException:
            if workers is not None:
                workers.stop()
            raise
        cache.num_blocks = self.runner.num_blocks  # sized on the GPU when it was 0
        # Blocks every layer's sliding window has left go back to the pool as requests proceed.
        window = kv_window(getattr(self.runner.model, "attention_layers", None))
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching, window)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.drafter = Drafter.build(config) if config.speculative else None

    def shutdown(self) -> None:
        self.runner.shutdown()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        req = self.scheduler.finish_request(request_id, status)
        if req is not None and self.drafter is not None:
            self.drafter.finish(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[CoreOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        out = self.runner.execute(sched)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[SampleLogprobs | None]] = {}
        if out is not None:
            sampling = [s.request for s in sched.scheduled if s.samples]
            for i, req in enumerate(sampling):
                sampled[req.request_id], logprobs[req.request_id] = out.tokens_of(i)
        num_outputs = {s.request.request_id: s.request.num_output_tokens for s in sched.scheduled}
        self.scheduler.update(sched, sampled)
        self.scheduler.observe_step(sched, time.perf_counter() - t0)
        if self.drafter is not None:
            self.drafter.observe(sched, sampled)
        results = []
        for s in sched.scheduled:
            req = s.request
            if req.request_id in sampled and req.status != RequestStatus.FINISHED_ABORTED:
                n = req.num_output_tokens - num_outputs[req.request_id]  # fewer than sampled when one stopped it
                results.append(
                    CoreOutput(req, req.output_token_ids[-n:] if n else [], logprobs[req.request_id][:n], req.finished)
                )
            elif req.pooling_params is not None and req.status == RequestStatus.FINISHED_STOPPED:
                results.append(CoreOutput(req, [], [], True))  # pooled: the embedding is its output
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        return results


def _start_tp_workers(config: EngineConfig) -> TPWorkers:
    hidden = config.model.hf_config.hidden_size
    # The all-reduce's shared buffer: one step's activations in float32 (bigger ones go in pieces).
    shm_bytes = min(max(config.scheduler.max_num_batched_tokens * hidden * 4, 1 << 20), 32 << 20)
    build_runner = functools.partial(
        ModelRunner,
        num_blocks=config.cache.num_blocks,
        block_size=config.cache.block_size,
        device_config=config.device,
        scheduler_config=config.scheduler,
    )
    return TPWorkers(
        config.parallel.tensor_parallel_size, config.parallel.num_threads, config.model, build_runner, shm_bytes
    )
