"""Offline API: LLM(model=...).generate(prompts, sampling_params), .chat(messages), .stream(...)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from tqdm import tqdm

from tokenmill.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from tokenmill.config import EngineArgs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import EmbeddingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request
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
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts through one continuously batched engine; outputs in input order.
        use_tqdm: a progress bar over finished requests, shown only when stderr is a terminal.
        lora_request: one adapter for every prompt, or one per prompt (None: the base model).
        priority: one per prompt (or one for all), with scheduling_policy="priority": lower first."""
        batch = _as_prompt_list(prompts, prompt_token_ids)
        params = _as_params_list(sampling_params, len(batch))
        loras = _as_lora_list(lora_request, len(batch))
        priorities = _as_priority_list(priority, len(batch))
        # Validate everything before queueing anything, so a bad prompt leaves no work behind.
        requests = [
            self.engine.make_requests(p, sp, lora_request=lr, priority=pr)
            for p, sp, lr, pr in zip(batch, params, loras, priorities)
        ]
        done = self._run([req for reqs in requests for req in reqs], "Generating", use_tqdm)
        return [merge_samples([done[r.request_id] for r in reqs], sp) for reqs, sp in zip(requests, params)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of prompts (text or token ids), in input order, batched by the engine as
        vLLM's LLM.embed: needs an embedding model (an encoder such as BERT) or task="embed".
        truncate_prompt_tokens: cut longer prompts to this many tokens (-1: max_model_len) instead of
        refusing them."""
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        requests = [self.engine.make_pooling_request(p, params) for p in _as_prompt_list(prompts, None)]
        done = self._run(requests, "Embedding", use_tqdm)
        return [EmbeddingRequestOutput.from_base(done[r.request_id]) for r in requests]

    def _run(self, requests: list[Request], desc: str, use_tqdm: bool) -> dict:
        """Queues requests (validated before, so a bad prompt leaves no work behind) and steps the
        engine until all have finished; their last outputs by request id. use_tqdm: a progress bar
        over finished requests, shown only when stderr is a terminal."""
        rids = [self.engine.enqueue(req) for req in requests]
        done: dict = {}
        bar = tqdm(total=len(rids), desc=desc, unit="req", disable=None if use_tqdm else True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return done

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); returns the hashes dropped."""
        return self.engine.reset_prefix_cache()

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's LLM.beam_search): the beam_width best sequences,
        best first; each round runs every live beam of every prompt in one continuous batch."""
        batch = _as_prompt_list(prompts, None)
        tok = self.engine.tokenizer
        limit = self.engine.config.scheduler.max_model_len
        searches = []
        for p in batch:
            ids = tok.encode(p) if isinstance(p, str) else list(p)
            room = max(limit - len(ids), 1)
            searches.append(
                BeamSearch(ids, replace(params, max_tokens=min(params.max_tokens, room)), self.engine.eos_token_ids)
            )
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


def _as_priority_list(priority, n: int) -> list[int]:
    if priority is None or isinstance(priority, int):
        return [priority or 0] * n
    priorities = list(priority)
    if len(priorities) != n:
        raise ValueError(f"{len(priorities)} priorities for {n} prompts")
    return priorities


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
    return replace(
        first,
        request_id=first.request_id.rsplit("-", 1)[0],
        outputs=comps,
        num_cached_tokens=min(o.num_cached_tokens for o in outs),
    )
