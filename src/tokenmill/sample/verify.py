"""Exact verification of draft tokens against the target model's logits.

A request verified with k drafts d_1..d_k has k+1 logits rows: row j scores the token after
d_1..d_j. Each row is sampled as the request would be at that point: `DraftPosition` is the
request with d_1..d_j appended, so penalties, min_tokens, bad words, the watermark's previous
token and the grammar's state (`MatcherAt`) are those of that position; the Sampler's logits
processing then runs over all rows at once.

Greedy rows accept d_j while it is the argmax. Sampled rows use rejection sampling
(rejection.py) with a one-hot draft distribution q (n-gram and suffix drafts): accept d_j with
probability p_j(d_j); at the first rejection emit a sample of norm(max(p_j - q, 0)); after k
acceptances emit a sample of p_{k+1}. Each emitted token is then distributed as p (the chi-square
tests in tests/spec_decode/test_spec_decode.py). Every request gets its accepted drafts plus one token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.request import Request
from tokenmill.sample.rejection import rejection_sample, target_distributions
from tokenmill.sample.sampler import SampleLogprobs, Sampler, SamplerOutput, SamplingBatch, host_logprobs

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from tokenmill.step import ScheduledRequest


class MatcherAt:
    """A grammar matcher as it would be after `tokens` (filled, then rolled back)."""

    def __init__(self, matcher: LLMatcher, tokens: list[int]) -> None:
        self.matcher, self.tokens = matcher, tokens

    def fill_bitmask(
        self, fill: Callable[[LLMatcher, torch.Tensor, int], None], bitmask: torch.Tensor, row: int
    ) -> None:
        ok = self.matcher.try_consume_tokens(self.tokens) if self.tokens else 0
        fill(self.matcher, bitmask, row)
        if ok:
            self.matcher.rollback(ok)


@dataclass
class DraftPosition:
    """A request as the sampler sees it after its drafts `drafts` (the attributes SamplingBatch reads)."""

    request: Request
    drafts: list[int]

    def __post_init__(self) -> None:
        r = self.request
        self.sampling_params, self.eos_token_ids = r.sampling_params, r.eos_token_ids
        self.bad_words_token_ids = r.bad_words_token_ids
        self.output_token_ids = r.output_token_ids + self.drafts
        self.all_token_ids = r.all_token_ids + self.drafts
        self.matcher = None if r.matcher is None else MatcherAt(r.matcher, self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def generator_for(self, device: torch.device) -> torch.Generator | None:
        return self.request.generator_for(device)


def verify_drafts(sampler: Sampler, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> SamplerOutput:
    """logits: [sum(k_i + 1), V] float32, each sampling request's rows in order (its last token's,
    then one per draft). Returns each request's accepted drafts and its next token, with logprobs."""
    positions: list[DraftPosition] = []
    starts: list[int] = []
    for s in scheduled:
        starts.append(len(positions))
        positions += [DraftPosition(s.request, s.spec_token_ids[:j]) for j in range(len(s.spec_token_ids) + 1)]
    dev = logits.device
    batch = SamplingBatch.from_requests(positions, logits.shape[-1], device=dev)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in batch.num_logprobs) else None
    probs, argmax = target_distributions(sampler, logits, batch)
    verified = rejection_sample(
        [s.spec_token_ids for s in scheduled],
        probs,
        argmax,
        [s.request.sampling_params.greedy for s in scheduled],
        _draft_probs(scheduled, probs),
        generators=[batch.generators[r0] for r0 in starts],
        generator=sampler._generator_for(dev),
    )
    accepted_ids: list[list[int]] = []
    next_ids: list[int] = []
    rows: list[list[int]] = []
    for tokens, r0 in zip(verified.token_ids, starts):
        accepted_ids.append(tokens[:-1])
        next_ids.append(tokens[-1])
        rows.append(list(range(r0, r0 + len(tokens))))
    accepted_lps: list[list[SampleLogprobs | None]] = [[None] * len(a) for a in accepted_ids]
    next_lps: list[SampleLogprobs | None] = [None] * len(scheduled)
    if raw_logprobs is not None:
        top_n = {i: n for i, s in enumerate(scheduled) if (n := s.request.sampling_params.logprobs) is not None}
        want = list(top_n)
        flat = [r for i in want for r in rows[i]]
        chosen = [t for i in want for t in accepted_ids[i] + [next_ids[i]]]
        idx = torch.tensor(flat, dtype=torch.long, device=dev)
        lps = host_logprobs(
            raw_logprobs[idx],
            torch.tensor(chosen, dtype=torch.long, device=dev),
            [top_n[i] for i in want for _ in rows[i]],
        )
        it = iter(lps)
        for i in want:
            accepted_lps[i] = [next(it) for _ in accepted_ids[i]]
            next_lps[i] = next(it)
    return SamplerOutput(next_ids, next_lps, accepted_ids, accepted_lps)


def _draft_probs(scheduled: list[ScheduledRequest], target_probs: torch.Tensor | None) -> torch.Tensor | None:
    """[sum(k_i), V]: each draft's q, None when all drafts are one-hot (n-gram, suffix, argmax
    drafts); one-hot rows for the one-hot drafts of a batch where a draft model sampled others."""
    if target_probs is None or all(s.spec_draft_probs is None for s in scheduled):
        return None
    rows = []
    for s in scheduled:
        if s.spec_draft_probs is not None:
            rows.append(s.spec_draft_probs.to(target_probs.device, torch.float32))
        elif s.spec_token_ids:
            ids = torch.tensor(s.spec_token_ids, device=target_probs.device)
            rows.append(torch.nn.functional.one_hot(ids, target_probs.shape[-1]).float())
    return torch.cat(rows)
