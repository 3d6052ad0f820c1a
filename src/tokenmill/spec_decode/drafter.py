"""The engine's side of speculative decoding: which requests get drafts, how many, and the counts.

After each step the Drafter proposes draft tokens for the running requests that are decoding
(`request.spec_token_ids`); the scheduler gives them slots next step and the runner verifies
them (verify.py). Speculating costs rows in the verification step whether or not the drafts
are accepted, so it is rationed (vLLM's fixed k is the upper bound):

- by expected gain against cost: each request has a decayed estimate `a` of the chance that a
  draft token is accepted, so its j-th draft is accepted with probability ~a**j. Requests are taken
  likeliest first and get drafts one row at a time while the row's expected tokens pay for its
  cost: a**j >= max(MIN_LAST_TOKEN_ACCEPT, tokens_so_far * row_cost / step_cost), with the step's
  cost modelled in units of a one-row step: each row up to MEMORY_BOUND_ROWS adds
  ROW_COST_MEMORY_BOUND (the weights' stream dominates, rows are nearly free), each row beyond adds
  ROW_COST_COMPUTE_BOUND. Measured on 2 CPU cores (SmolLM2 bf16, fused step): ~0.5 ms a row below
  8 rows and ~1.5 ms beyond, against ~11 ms for one row. So a lone request drafts whenever
  a**j >= 0.3, while at 8 decoding requests a draft needs a >~ 0.7 and at 32 almost nothing pays
  (at most `max_batch_rows` rows in all). A request that stops drafting is probed with one
  draft every PROBE_EVERY steps, only while the step is small enough for a row to be cheap.

Proposers: n-gram and suffix draft one request at a time (`propose(req, k)`); a draft model
drafts for all chosen requests at once (`propose_many`: k batched forward passes), and may
return the probabilities its drafts were sampled from (`Drafts.probs`), which verification uses
as q.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.request import Request, RequestStatus
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.drafts import Drafts
from tokenmill.spec_decode.ngram import NgramProposer, TokenBuffer
from tokenmill.spec_decode.suffix import SuffixProposer

MIN_LAST_TOKEN_ACCEPT = 0.3
DECAY = 0.8  # weight of the past in the acceptance estimate, per verified step
PROBE_EVERY = 8
DEFAULT_MAX_BATCH_ROWS = 32
MEMORY_BOUND_ROWS = 8  # rows up to which a step costs about the same as one row (CPU, measured)
ROW_COST_MEMORY_BOUND = 0.05  # a row's cost up to there, in one-row steps
ROW_COST_COMPUTE_BOUND = 0.13  # and beyond


@dataclass
class SpecDecodeStats:
    """Cumulative, as vLLM's spec-decode counters: drafts (requests x steps that carried drafts),
    draft tokens, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step per request: accepted drafts + the one always sampled."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Track:
    accepted: float = 2.0  # decayed counts of accepted draft tokens and of trials (optimistic start)
    trials: float = 2.0
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class Drafter:
    def __init__(
        self, config: SpeculativeConfig, proposer, max_model_len: int, max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    ):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.max_model_len, self.max_batch_rows = max_model_len, max_batch_rows
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._tracks: dict[str, _Track] = {}

    @classmethod
    def build(cls, engine: EngineConfig) -> Drafter:
        config, scheduler = engine.speculative, engine.scheduler
        if config.method == "ngram":
            proposer = _ByTokens(
                NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
            )
        elif config.method == "suffix":
            proposer = _Suffix(SuffixProposer.from_config(config))
        else:
            proposer = DraftModelProposer(
                config.model,
                config.quantization,
                config.dtype,
                engine.model,
                engine.cache,
                scheduler,
                engine.device,
                engine.seed,
            )
        return cls(config, proposer, scheduler.max_model_len)

    # ---- after each step ----------------------------------------------------------------
    def observe(self, sched, sampled: dict[str, list[int]]) -> None:
        """Counts what the step's verification accepted and updates each request's estimate."""
        for s in sched.scheduled:
            req = s.request
            tokens = sampled.get(req.request_id)
            if tokens is None:
                continue
            self.proposer.add_tokens(req, tokens)
            if req.finished:
                self.finish(req)
            k = len(s.spec_token_ids)
            if not k:
                continue
            accepted = len(tokens) - 1
            st = self.stats
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += accepted
            for pos in range(accepted):
                st.accepted_per_pos[pos] += 1
            t = self._tracks.setdefault(req.request_id, _Track())
            t.accepted = DECAY * t.accepted + accepted
            t.trials = DECAY * t.trials + accepted + (1 if accepted < k else 0)

    def finish(self, req: Request) -> None:
        self._tracks.pop(req.request_id, None)
        self.proposer.finish(req)

    # ---- before the next --------------------------------------------------------------
    def propose(self, running: list[Request]) -> None:
        """Sets spec_token_ids of the decoding requests that should speculate next step."""
        rows = len(running)
        if rows >= self.max_batch_rows:
            return
        candidates = []
        for req in running:
            if (
                req.status == RequestStatus.RUNNING
                and req.num_computed_tokens == req.num_tokens - 1
                and req.num_output_tokens > 0
            ):
                # drafts must not pass max_tokens (with the token always sampled after them) nor the context
                room = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
                if room > 0:
                    candidates.append((self._tracks.setdefault(req.request_id, _Track()), req, room))
        candidates.sort(key=lambda c: -c[0].rate)  # the likeliest to gain first
        expected, cost = float(rows), step_cost(rows)  # the step's expected tokens and its cost so far
        wanted = []
        for t, req, room in candidates:
            k, p = 0, 1.0
            while k < min(self.k, room) and rows < self.max_batch_rows:
                p *= t.rate
                extra = row_cost(rows + 1)
                if p < max(MIN_LAST_TOKEN_ACCEPT, expected * extra / (cost + extra)):
                    break
                k, rows, expected, cost = k + 1, rows + 1, expected + p, cost + extra
            if k == 0:
                t.idle_steps += 1
                if t.idle_steps < PROBE_EVERY or rows >= min(MEMORY_BOUND_ROWS, self.max_batch_rows):
                    continue
                k, rows = 1, rows + 1  # a probe: one draft, to notice when drafts start to be accepted
            wanted.append((req, k, t))
        if not wanted:
            return
        items = [(req, k) for req, k, _ in wanted]
        rows_left = sum(k for _, k in items)
        many = getattr(self.proposer, "propose_many", None)  # a draft model drafts for all at once
        proposals = many(items, rows_left, running) if many else _one_by_one(self.proposer, items, rows_left)
        for (req, _, t), drafts in zip(wanted, proposals):
            tokens = drafts.token_ids
            if req.matcher is not None:
                tokens = _grammar_prefix(req.matcher, tokens)
            if tokens:
                t.idle_steps = 0
                req.spec_token_ids = tokens
                req.spec_draft_probs = None if drafts.probs is None else drafts.probs[: len(tokens)]


def row_cost(row: int) -> float:
    """What the step's `row`-th row (1-based) adds to its cost, in one-row steps."""
    return ROW_COST_MEMORY_BOUND if row <= MEMORY_BOUND_ROWS else ROW_COST_COMPUTE_BOUND


def step_cost(rows: int) -> float:
    """A step of `rows` rows in one-row steps."""
    return 1.0 + sum(row_cost(r) for r in range(2, rows + 1))


def _one_by_one(proposer, items: list[tuple[Request, int]], rows_left: int) -> list[Drafts]:
    """Drafts of a proposer that takes one request at a time, the first items first."""
    out = []
    for req, k in items:
        tokens = proposer.propose(req, min(k, rows_left)) if rows_left > 0 else []
        rows_left -= len(tokens)
        out.append(Drafts(tokens))
    return out


class _ByTokens:
    """A proposer that needs only the request's tokens (n-gram prompt lookup), kept per request
    as a numpy buffer (converting the whole list each step would cost more than the lookup)."""

    def __init__(self, proposer):
        self.proposer = proposer
        self._buffers: dict[str, TokenBuffer] = {}

    def propose(self, req: Request, k: int) -> list[int]:
        buf = self._buffers.get(req.request_id)
        if buf is None:
            buf = self._buffers[req.request_id] = TokenBuffer(req.all_token_ids)
        elif len(buf) != req.num_tokens:
            buf.extend(req.all_token_ids[len(buf) :])
        return self.proposer.propose(buf.view(), k)

    def add_tokens(self, req: Request, tokens: list[int]) -> None:
        pass

    def finish(self, req: Request) -> None:
        self._buffers.pop(req.request_id, None)


class _Suffix:
    """Suffix decoding: the request's own tokens and earlier requests' outputs (suffix.py)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, req: Request, k: int) -> list[int]:
        return self.proposer.propose(req.request_id, req.all_token_ids, k, num_prompt_tokens=req.num_prompt_tokens)

    def add_tokens(self, req: Request, tokens: list[int]) -> None:
        pass  # propose() syncs the request's context

    def finish(self, req: Request) -> None:
        self.proposer.finish_request(req.request_id, cache=req.status != RequestStatus.FINISHED_ABORTED)


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts the grammar accepts (validated without consuming)."""
    if matcher.is_stopped():
        return []
    return drafts[: matcher.validate_tokens(drafts)]
