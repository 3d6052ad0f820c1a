"""One token budget per step, no prefill/decode phases (vLLM V1 style).

Each step: running requests get their tokens first (1 for decode, the next chunk for a
prompt still being prefilled), then waiting requests are admitted FCFS, their prompts
chunked to fit the budget, after the blocks the prefix cache already holds. When a running
request cannot get a block, the latest-arrived running request is preempted: its blocks are
freed and it goes back to the front of the waiting queue to be recomputed later, keeping the
output it has produced.

With `policy="priority"` (vLLM's --scheduling-policy priority) both queues are kept in
(priority, arrival) order, lower first: waiting requests are admitted in that order, running
requests get their tokens in that order, and the one preempted when blocks run out is the last,
the lowest-priority (highest value) and, among equals, the latest-arrived; a preempted request
re-enters the waiting queue at its place in that order.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.engine.step_budget import StepBudget
from tokenmill.kv_cache import KVCacheManager
from tokenmill.request import Request, RequestStatus
from tokenmill.step import ScheduledRequest, SchedulerOutput


def policy_key(req: Request) -> tuple[int, float]:
    """Order under the priority policy: lower priority value first, then earlier arrival."""
    return req.priority, req.arrival_time


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.by_priority = config.policy == "priority"
        self.step_budget = StepBudget(config.itl_target_ms / 1000, config.max_num_batched_tokens)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Into the waiting queue: at its place in priority order; under FCFS at the back, or at
        the front for a preempted request (it goes before those that have not run yet)."""
        if self.by_priority:
            bisect.insort(self.waiting, request, key=policy_key)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (abort, or stop on a stop string) a request wherever it is; frees its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(req)
        return req

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. Running requests, decode rows first (a token each, and a decoding request's draft tokens,
        # budget and pool permitting), then the next chunks of prompts being prefilled; each group in
        # arrival (or priority) order, and a preemption takes the last running request not yet scheduled.
        if self.by_priority:
            self.running.sort(key=policy_key)  # last step's admissions were appended at the end
        loras: set[int] = set()  # the step's LoRA adapters (at most max_loras)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        stopped = False  # a request preempted itself: it could not get its blocks even after every other went
        for req in decoding:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING or not self._lora_fits(req, loras):
                continue  # preempted this step, or its adapter waits for a step with a free slot
            spec = req.spec_token_ids[: budget - 1]
            probs = req.spec_draft_probs[: len(spec)] if spec and req.spec_draft_probs is not None else None
            req.spec_token_ids, req.spec_draft_probs = [], None
            if spec and not self.kv.allocate_slots(req, 1 + len(spec)):
                spec = []  # no room to speculate: decode one token, preempting only for that
            if not spec and not self._allocate_preempting(req, 1, scheduled_ids, out):
                stopped = True
                break
            n = 1 + len(spec)
            out.scheduled.append(
                ScheduledRequest(req, n, self.kv.block_ids(req.request_id), spec, probs if spec else None)
            )
            scheduled_ids.add(req.request_id)
            budget -= n
        out.num_decode_rows = len(out.scheduled)
        # Prompt tokens: within the budget, and while any request decodes within what keeps the step
        # at the target inter-token latency (step_budget.py).
        prompt_budget = min(budget, self.step_budget.prefill_tokens(out.num_decode_rows > 0))
        for req in prefilling:
            if prompt_budget <= 0 or stopped:
                break
            if req.status != RequestStatus.RUNNING or not self._lora_fits(req, loras):
                continue
            n = min(req.num_tokens - req.num_computed_tokens, prompt_budget)
            if not self._allocate_preempting(req, n, scheduled_ids, out):
                stopped = True
                break
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
            scheduled_ids.add(req.request_id)
            prompt_budget -= n

        # 2. Waiting requests in queue order (FCFS, or by priority); never admit while a preemption
        # happened this step.
        w = 0
        while (
            w < len(self.waiting) and prompt_budget > 0 and len(self.running) < cfg.max_num_seqs and not out.preempted
        ):
            req = self.waiting[w]
            if not self._lora_fits(req, loras):
                w += 1  # FCFS among the requests this step's adapters allow
                continue
            if self._sibling_prefilling(req):
                break  # next step it finds the shared prompt blocks in the prefix cache
            computed = self.kv.get_computed_blocks(req)
            num_cached = len(computed) * self.kv.block_size
            remaining = req.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and remaining > prompt_budget:
                break
            n = min(remaining, prompt_budget)
            if not self.kv.allocate_slots(req, n, computed):
                break
            self.kv.record_admission(req, num_cached)
            req.num_computed_tokens = num_cached
            req.num_cached_tokens = num_cached
            del self.waiting[w]
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
            prompt_budget -= n

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _allocate_preempting(self, req: Request, n: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
        """Slots for n more tokens of req, preempting the last running request not yet scheduled this
        step (req itself last of all) until they fit. False when req had to preempt itself."""
        while not self.kv.allocate_slots(req, n):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled_ids)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The time a scheduled step took (schedule to update), for the next steps' prompt budget."""
        self.step_budget.observe(out.num_batched_tokens - out.num_decode_tokens, out.num_decode_rows, seconds)

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        """Whether req's adapter fits this step (taking its slot if so): a step holds at most
        max_loras distinct adapters, as many as the model runner has slots for."""
        if req.lora is None:
            return True
        if req.lora.uid in loras:
            return True
        if len(loras) >= self.config.max_loras:
            return False
        loras.add(req.lora.uid)
        return True

    def _sibling_prefilling(self, req: Request) -> bool:
        """Parallel samples (n > 1) share their prompt's KV blocks through the prefix cache: a
        sample waits while a sibling is still computing the prompt, then takes references on its
        full blocks and recomputes only the last, partial one."""
        if req.parent_id is None or not self.kv.enable_prefix_caching or req.prompt_logprobs is not None:
            return False
        return any(
            r.parent_id == req.parent_id and r.num_computed_tokens < r.num_prompt_tokens - 1 for r in self.running
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, preempted=True)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens (one, or a verified run of drafts and one more), finishing
        a request at the first that hits a stop condition (EOS, stop token, max_tokens, context
        length); advance computed tokens to the verified ones (rejected drafts' K/V are left to be
        overwritten), hash the blocks they fill and free blocks only rejected drafts used. Returns
        the finished requests. `sampled` maps a request id to its tokens; requests still in their
        prompt have none."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled.get(req.request_id, ())
            status = None
            for tok in tokens:
                req.append_output_token(tok)
                if req.matcher is not None:
                    req.matcher.consume_token(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    break
            # K/V is now computed for every token but the newest (rejected drafts' slots get overwritten).
            req.num_computed_tokens = req.num_tokens - 1 if tokens else req.num_computed_tokens + s.num_new_tokens
            self.kv.cache_blocks(req)
            if req.pooling_params is not None and req.num_computed_tokens == req.num_tokens:
                status = RequestStatus.FINISHED_STOPPED  # its prompt has run: pooled, done, blocks freed
            if status is not None:
                self.finish_request(req.request_id, status)
                finished.append(req)
            elif len(tokens) <= len(s.spec_token_ids):  # some drafts were rejected
                self.kv.trim(req, req.num_tokens)
        return finished

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in (p.stop_token_ids or ()):  # a list after SamplingParams.__post_init__
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if req.matcher is not None and req.matcher.is_stopped():  # the grammar is complete
            return RequestStatus.FINISHED_STOPPED
        return None

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": self.kv.usage(),
            "num_preemptions": self.num_preemptions,
            "prefix_cache_hit_rate": self.kv.stats.hit_rate,
        }
