"""Beam search, as vLLM V1 runs it: outside the engine, one token per round.

Each round sends every live beam to the engine as a one-token greedy request asking for its top
2 x beam_width logprobs; the candidates are ranked by cumulative logprob and the best
beam_width continue (a candidate ending in EOS is set aside as finished). The prefix cache
keeps each round cheap: a beam's prompt and earlier tokens are in cached blocks, so only its
last partial block is recomputed. Finished sequences are ranked by cumulative logprob / length
** length_penalty (Hugging Face's rule).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's and the generated ones
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    finished: bool = False
    text: str = ""

    @property
    def output_tokens(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.output_tokens), 1) ** length_penalty


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


class BeamSearch:
    """The search state of one prompt; the caller runs each round's requests on an engine."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.params = params
        self.eos = eos_token_ids
        self.beams = [BeamSearchSequence(list(prompt_ids), len(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.rounds >= self.params.max_tokens

    def round_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * self.params.beam_width, ignore_eos=True)

    def advance(self, outs: list[RequestOutput]) -> None:
        """outs[i]: the one-token output of self.beams[i]."""
        # (cumulative logprob, beam, token) for every candidate, and sequences only for those that can
        # be kept: the best width + (EOS candidates) (n=128 ranks 32,768 candidates a round, on the
        # server's event loop). nlargest is sorted(...)[:k]: ties keep beam, then token order.
        width, live = self.params.beam_width, []
        scored = [
            (beam.cum_logprob + lp.logprob, i, tok)
            for i, (beam, out) in enumerate(zip(self.beams, outs))
            for tok, lp in out.outputs[0].logprobs[0].items()
        ]
        keep = width + (0 if self.params.ignore_eos else sum(1 for _, _, tok in scored if tok in self.eos))
        for cum, i, tok in heapq.nlargest(keep, scored, key=lambda x: x[0]):
            beam = self.beams[i]
            c = BeamSearchSequence(beam.tokens + [tok], beam.num_prompt_tokens, cum)
            if len(live) == width:
                break
            if not self.params.ignore_eos and c.tokens[-1] in self.eos:
                if len(self.finished) < width or c.cum_logprob > min(s.cum_logprob for s in self.finished):
                    c.finished = True
                    self.finished.append(c)
            else:
                live.append(c)
        self.beams = live
        self.rounds += 1

    def result(self, decode) -> BeamSearchOutput:
        pool = self.finished + self.beams
        pool.sort(key=lambda s: s.score(self.params.length_penalty), reverse=True)
        best = pool[: self.params.beam_width]
        for s in best:
            toks = s.output_tokens[:-1] if s.finished else s.output_tokens
            s.text = decode(toks)
        return BeamSearchOutput(best)
