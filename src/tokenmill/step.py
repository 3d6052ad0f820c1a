"""What one engine step hands from the scheduler to the worker: which requests run, how many
tokens each computes, where their KV blocks are, and the drafts to verify. A leaf: the engine
(which builds it) and the worker (which runs it) both import it, and it imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # draft tokens included
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step (after its last token)
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), V] they were sampled from; None: one-hot

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens: a new token is sampled (a
        pooling request's last chunk pools instead)."""
        r = self.request
        return (
            r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens
            and r.pooling_params is None
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decode_rows: int = 0  # the first num_decode_rows of `scheduled` decode (drafts included)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled[: self.num_decode_rows])

    @property
    def empty(self) -> bool:
        return not self.scheduled
