"""Offline API: LLM(model=...).generate(prompts, sampling_params), .chat(messages), .stream(...)."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Sequence

from tqdm import tqdm

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    """vLLM-style offline entry point; every EngineArgs field is a keyword argument."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine.from_args(model, **engine_args)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes now (else they end with this process)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts through one continuously batched engine; outputs in input order.
        use_tqdm: a progress bar over finished requests, shown only when stderr is a terminal.
        lora_request: one adapter for every prompt, or one per prompt (None: the base model)."""
        batch = _as_prompt_list(prompts, prompt_token_ids)
        params = _as_params_list(sampling_params, len(batch))
        loras = _as_lora_list(lora_request, len(batch))
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        requests = [self.engine.make_requests(p, sp, lora_request=lr) for p, sp, lr in zip(batch, params, loras)]
        order = {self.engine.enqueue(req): (i, j) for i, reqs in enumerate(requests) for j, req in enumerate(reqs)}
        samples: list[list[RequestOutput | None]] = [[None] * len(reqs) for reqs in requests]
        # disable=None: tqdm shows the bar only when stderr is a terminal
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=None if use_tqdm else True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        i, j = order[out.request_id]
                        samples[i][j] = out
                        bar.update(1)
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [merge_samples(outs, sp) for outs, sp in zip(samples, params)]  # type: ignore[arg-type]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's LLM.beam_search): the beam_width best sequences,
        best first; each round runs every live beam of every prompt in one continuous batch."""
        batch = _as_prompt_list(prompts, None)
        tok = self.engine.tokenizer
        limit = self.engine.config.scheduler.max_model_len
        searches = []
        for p in batch:
            ids = tok.encode(p) if isinstance(p, str) else list(p)
            room = max(limit - len(ids), 1)
            searches.append(BeamSearch(ids, replace(params, max_tokens=min(params.max_tokens, room)),
                                       self.engine.eos_token_ids))
        while not all(s.done for s in searches):
            live = [s for s in searches if not s.done]
            seqs = [b.tokens for s in live for b in s.beams]
            outs = self.generate(prompt_token_ids=seqs, sampling_params=live[0].round_params(), use_tqdm=False)
            k = 0
            for s in live:
                n = len(s.beams)  # before advance() replaces them
                s.advance(outs[k : k + n])
                k += n
        return [s.result(lambda t: tok.decode(t, skip_special_tokens=True)) for s in searches]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput per new token (delta_text holds the new text)."""
        rid = self.engine.add_request(None, prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
                if not self.engine.has_unfinished_requests():
                    return
        finally:
            if rid in self.engine.core.scheduler.requests:
                self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        ids = [self.engine.apply_chat_template(c, add_generation_prompt) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompt_token_ids=ids, sampling_params=sampling_params, use_tqdm=use_tqdm)


def _as_prompt_list(prompts, prompt_token_ids) -> list[PromptType]:
    if prompt_token_ids is not None:
        if prompts is not None:
            raise ValueError("give prompts or prompt_token_ids, not both")
        return [list(p) for p in prompt_token_ids]
    if prompts is None:
        raise ValueError("no prompts given")
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # a single prompt of token ids
        return [prompts]
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


__all__ = ["LLM", "EngineArgs"]


def _as_lora_list(lora, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    loras = list(lora)
    if len(loras) != n:
        raise ValueError(f"{len(loras)} lora_requests for {n} prompts")
    return loras


def merge_samples(outs: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """The samples of one prompt as one RequestOutput: all n of them, or with best_of the n with
    the highest cumulative logprob (vLLM's rule), indexed 0..n-1."""
    if len(outs) == 1:
        return outs[0]
    comps = [o.outputs[0] for o in outs]
    if params.num_samples > params.n:
        comps = sorted(comps, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
        if params.logprobs is None:  # asked for internally, to rank
            for c in comps:
                c.logprobs = c.cumulative_logprob = None
    for i, c in enumerate(comps):
        c.index = i
    first = outs[0]
    return replace(first, request_id=first.request_id.rsplit("-", 1)[0], outputs=comps,
                   num_cached_tokens=min(o.num_cached_tokens for o in outs))
