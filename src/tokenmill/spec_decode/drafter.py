"""The engine's side of speculative decoding: which requests get drafts, how many, and the counts.

After each step the Drafter proposes draft tokens for the running requests that are decoding
(`request.spec_token_ids`); the scheduler gives them slots next step and the runner verifies
them (verify.py). Speculating costs rows in the verification step whether or not the drafts
are accepted, so it is rationed (vLLM's fixed k is the upper bound):

- per request, by its recent acceptance: a decayed estimate `a` of the chance that a draft token
  is accepted; the request gets the largest k <= num_speculative_tokens whose last draft is still
  likely enough to be accepted (a**k >= MIN_LAST_TOKEN_ACCEPT). A request whose drafts keep
  failing stops drafting, and is probed with one draft token every PROBE_EVERY steps;
- per step, by batch size: at most `max_batch_rows` rows in the step (decode rows plus drafts),
  given to the requests most likely to gain. Measured on 2 CPU cores (benchmarks/spec_decode.py,
  SmolLM2 bf16): with a cap of 64 rows, 32 concurrent requests ran at 0.93x of no speculation
  (the step is compute-bound there and verification rows cost about what they save), so the
  cap is 32: a batch of 32 decoding requests does not speculate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config import EngineConfig
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import TokenBuffer

MIN_LAST_TOKEN_ACCEPT = 0.3
DECAY = 0.8  # weight of the past in the acceptance estimate, per verified step
PROBE_EVERY = 8
DEFAULT_MAX_BATCH_ROWS = 32


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
class Drafts:
    """What a proposer gives one request: draft tokens, and for sampled drafts the probabilities
    they were drawn from ([len(token_ids), V]; None for one-hot drafts: n-gram, suffix, argmax)."""

    token_ids: list[int]
    probs: object | None = None


@dataclass
class _Track:
    accepted: float = 2.0  # decayed counts of accepted draft tokens and of trials (optimistic start)
    trials: float = 2.0
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int,
                 max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.max_model_len, self.max_batch_rows = max_model_len, max_batch_rows
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._tracks: dict[str, _Track] = {}

    @classmethod
    def build(cls, engine: EngineConfig) -> Drafter:
        config, scheduler = engine.speculative, engine.scheduler
        if config.method == "ngram":
            from tokenmill.spec_decode.ngram import NgramProposer

            proposer = _ByTokens(NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                               config.prompt_lookup_max))
        elif config.method == "suffix":
            from tokenmill.spec_decode.suffix import SuffixProposer

            proposer = _Suffix(SuffixProposer.from_config(config))
        else:
            from tokenmill.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(config.model, config.quantization, config.dtype, engine.model,
                                          engine.cache, scheduler, engine.device, engine.seed)
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
        decoding = [r for r in running if r.status == RequestStatus.RUNNING
                    and r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens > 0]
        rows_left = self.max_batch_rows - len(running)
        if rows_left <= 0:
            return
        wanted = []
        for req in decoding:
            t = self._tracks.setdefault(req.request_id, _Track())
            k = self._k_for(t)
            if k == 0:
                t.idle_steps += 1
                if t.idle_steps < PROBE_EVERY:
                    continue
                k = 1
            # Room left: drafts must not pass max_tokens (with the token always sampled after them)
            # nor the context.
            room = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
            k = min(k, room)
            if k > 0:
                wanted.append((t.rate, req, k, t))
        wanted.sort(key=lambda w: -w[0])  # the likeliest to gain first
        items = [(req, k) for _, req, k, _ in wanted]
        many = getattr(self.proposer, "propose_many", None)  # a draft model drafts for all at once
        proposals = many(items, rows_left, running) if many else _one_by_one(self.proposer, items, rows_left)
        for (_, req, _, t), drafts in zip(wanted, proposals):
            tokens = drafts.token_ids
            if req.matcher is not None:
                tokens = _grammar_prefix(req.matcher, tokens)
            if tokens:
                t.idle_steps = 0
                req.spec_token_ids = tokens
                req.spec_draft_probs = None if drafts.probs is None else drafts.probs[: len(tokens)]

    def _k_for(self, t: _Track) -> int:
        a = t.rate
        k = 0
        while k < self.k and a ** (k + 1) >= MIN_LAST_TOKEN_ACCEPT:
            k += 1
        return k


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
            buf.extend(req.all_token_ids[len(buf):])
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
