"""A request as the engine core sees it: token ids, progress, and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from tokenmill.lora.adapter import LoRAAdapter
    from tokenmill.sample.sampler import SampleLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    cache_salt: str | None = None  # requests share cached prefixes only with the same salt
    priority: int = 0  # --scheduling-policy priority: lower runs first (ties by arrival)
    parent_id: str | None = None  # the samples of one n > 1 request share a parent
    matcher: LLMatcher | None = None  # when the output is constrained (structured output)
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs with; None: the base model
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # from SamplingParams.bad_words
    # prompt_logprobs[i]: logprobs of prompt token i + 1 (filled as prompt chunks run; None until then)
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # A pooling (embedding) request: its prompt runs once, no token is sampled, and it finishes with its
    # embedding in pooled_data (model/pooling.py); its KV blocks go back at once, never prefix-cached.
    pooling_params: PoolingParams | None = None
    pooled_data: torch.Tensor | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache. A request needs compute while this < num_tokens.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Speculative decoding: tokens proposed for the next step, verified there (spec_decode/).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), V] for sampled drafts (draft model)
    generator: torch.Generator | None = None  # the seed's CPU generator (see generator_for)
    _device_generators: dict[torch.device, torch.Generator] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )  # device -> generator
    # Timing, for metrics.
    scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (len(self.prompt_token_ids) - 1)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        """The seed's generator on `device` (None when unseeded). Each device keeps its own stream,
        made on first use from the seed, so a seeded request draws the same noise whatever batch it
        is in; CPU's is `generator`, made at creation as before."""
        if self.generator is None or device.type == "cpu":
            return self.generator
        g = self._device_generators.get(device)
        if g is None:
            seed = self.sampling_params.seed
            assert seed is not None  # a generator is made only for a seeded request
            g = self._device_generators[device] = torch.Generator(device=device).manual_seed(seed)
        return g

    @property
    def cache_key(self) -> bytes:
        """Extra bytes in every block hash: what besides the tokens makes K/V differ (the salt, the
        adapter: one prompt under two adapters has two sets of K/V)."""
        key = self.cache_salt.encode() if self.cache_salt else b""
        return key + b"|lora:%d" % self.lora.uid if self.lora is not None else key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        # Filled in by the engine (resolved against max_model_len) before scheduling.
        assert self.sampling_params.max_tokens is not None
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finished(self) -> bool:
        return self.status.finished
