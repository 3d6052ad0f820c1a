"""Turns the core's per-step tokens into RequestOutputs: text, stop strings, logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

from tokenizers import Tokenizer

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_core import CoreOutput
from tokenmill.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.request import Request, RequestStatus
from tokenmill.sample.sampler import SampleLogprobs


@dataclass
class RequestState:
    request: Request
    detok: IncrementalDetokenizer | None  # None for a pooling request (no text)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0
    num_tokens: int = 0  # output tokens taken (a step's tokens after a stop string are not)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = (
        None  # converted once, when every prompt position is scored
    )
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # each token's text for logprobs, decoded once: n=128 beams ask for 256 logprobs each a round,
        # 32,768 decodes on the engine thread (between two steps of every other request) otherwise
        self._token_text: dict[int, str] = {}
        self.states: dict[str, RequestState] = {}

    def add_request(self, req: Request) -> None:
        if req.pooling_params is not None:
            self.states[req.request_id] = RequestState(req, None, metrics=RequestMetrics(req.arrival_time))
            return
        p = req.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            req.prompt_token_ids,
            p.skip_special_tokens,
            cast("list[str]", p.stop),  # a list after SamplingParams.__post_init__
            p.include_stop_str_in_output,
        )
        state = RequestState(req, detok, metrics=RequestMetrics(req.arrival_time))
        if p.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.states[req.request_id] = state

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the RequestOutputs (PoolingRequestOutputs for pooling requests) and the ids of
        requests that hit a stop string (the caller finishes those in the core)."""
        results: list[RequestOutput | PoolingRequestOutput] = []
        stopped: list[str] = []
        now = time.monotonic()
        for o in outputs:
            state = self.states.get(o.request.request_id)
            if state is None:
                continue
            req = o.request
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                state.metrics.first_scheduled_time = req.scheduled_time
            if state.detok is None:  # pooled: its one output
                results.append(self._pooling_output(state, True))
                continue
            stop = None
            for tok, lp in zip(o.new_token_ids, o.logprobs):
                stop = state.detok.add_token(tok)
                state.num_tokens += 1
                if lp is not None and state.logprobs is not None:
                    assert state.cumulative_logprob is not None  # set with logprobs
                    state.logprobs.append(self._logprob_dict(tok, lp))
                    state.cumulative_logprob += lp.token_logprob
                if stop is not None:
                    break
            finished = o.finished
            if stop is not None:
                req.stop_reason = stop
                if finished:  # finished by length/EOS on the very token that completed a stop string
                    req.status = RequestStatus.FINISHED_STOPPED
                else:  # the engine finishes it in the core, which frees its blocks
                    stopped.append(req.request_id)
                    finished = True
            results.append(self._make_output(state, finished, RequestStatus.FINISHED_STOPPED if stop else None))
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        state = self.states.get(request_id)
        if state is None:
            return None
        if state.detok is None:
            return self._pooling_output(state, False)
        return self._make_output(state, True, RequestStatus.FINISHED_ABORTED)

    def _pooling_output(self, state: RequestState, pooled: bool) -> PoolingRequestOutput:
        """A pooling request's result (data None when it was aborted before it pooled)."""
        req = state.request
        state.metrics.finished_time = time.monotonic()
        del self.states[req.request_id]
        return PoolingRequestOutput(
            req.request_id,
            PoolingOutput(req.pooled_data if pooled else None),
            req.prompt_token_ids,
            True,
            req.prompt,
            state.metrics,
        )

    def _make_output(self, state: RequestState, finished: bool, status: RequestStatus | None = None) -> RequestOutput:
        req = state.request
        assert state.detok is not None  # not a pooling request
        status = status or req.status
        delta_text = state.detok.take_delta(finished)
        token_ids = req.output_token_ids[: state.num_tokens]
        delta_ids = token_ids[state.sent_tokens :]
        state.sent_tokens = len(token_ids)
        if finished:
            state.metrics.finished_time = time.monotonic()
            state.metrics.num_preemptions = req.num_preemptions
            del self.states[req.request_id]
        comp = CompletionOutput(
            index=0,
            text=state.detok.text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.logprobs,
            finish_reason=status.finish_reason if finished else None,
            stop_reason=req.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )
        if state.prompt_logprobs is None and req.prompt_logprobs is not None:
            scored = [x for x in req.prompt_logprobs if x is not None]
            if len(scored) == len(req.prompt_logprobs):  # every position
                state.prompt_logprobs = [None]
                state.prompt_logprobs += [self._logprob_dict(t, lp) for t, lp in zip(req.prompt_token_ids[1:], scored)]
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [comp],
            finished,
            state.metrics,
            req.num_cached_tokens,
            state.prompt_logprobs,
        )

    def _logprob_dict(self, token_id: int, lp: SampleLogprobs) -> dict[int, Logprob]:
        d = {token_id: Logprob(lp.token_logprob, lp.rank, self._text(token_id))}
        for rank, (tid, val) in enumerate(lp.top, start=1):
            if tid not in d:
                d[tid] = Logprob(val, rank, self._text(tid))
        return d

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
