"""Beam search's rounds stay cheap for the other requests: a round ranks beam_width x 2 x beam_width
candidates on the server's event loop, building sequences only for those it can keep, and the
logprob texts it asks for are decoded once per token, not once per candidate, on the engine thread."""

from __future__ import annotations

import random

import pytest

from tokenmill import beam_search
from tokenmill.beam_search import BeamSearch, BeamSearchParams
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput


def reference_advance(search: BeamSearch, outs: list[RequestOutput]) -> tuple[list, list]:
    """The round as first written: every candidate a sequence, all sorted."""
    cands = []
    for beam, out in zip(search.beams, outs):
        for tok, lp in out.outputs[0].logprobs[0].items():
            cands.append((beam.tokens + [tok], beam.cum_logprob + lp.logprob))
    cands.sort(key=lambda c: c[1], reverse=True)
    live, finished = [], [(s.tokens, s.cum_logprob) for s in search.finished]
    width = search.params.beam_width
    for tokens, cum in cands:
        if len(live) == width:
            break
        if not search.params.ignore_eos and tokens[-1] in search.eos:
            if len(finished) < width or cum > min(c for _, c in finished):
                finished.append((tokens, cum))
        else:
            live.append((tokens, cum))
    return live, finished


def round_outputs(search: BeamSearch, rng: random.Random, vocab: int) -> list[RequestOutput]:
    outs = []
    k = 2 * search.params.beam_width
    for b in search.beams:
        toks = rng.sample(range(vocab), k)
        lps = {t: Logprob(round(rng.uniform(-6, 0), 1), r + 1, "") for r, t in enumerate(toks)}  # ties on purpose
        outs.append(RequestOutput("r", None, b.tokens, [CompletionOutput(0, "", [toks[0]], None, [lps])], True))
    return outs


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_round_keeps_what_sorting_every_candidate_keeps(ignore_eos):
    rng = random.Random(0)
    search = BeamSearch(
        [1, 2, 3], BeamSearchParams(beam_width=8, max_tokens=6, ignore_eos=ignore_eos), frozenset({5, 6, 7})
    )
    while not search.done:
        outs = round_outputs(search, rng, vocab=40)  # a small vocabulary: EOS candidates in most rounds
        live, finished = reference_advance(search, outs)
        search.advance(outs)
        assert [(s.tokens, s.cum_logprob) for s in search.beams] == live
        assert [(s.tokens, s.cum_logprob) for s in search.finished] == finished


def test_a_round_builds_sequences_only_for_the_kept(monkeypatch):
    built = []

    class Counting(beam_search.BeamSearchSequence):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(beam_search, "BeamSearchSequence", Counting)
    search = BeamSearch(
        list(range(64)), BeamSearchParams(beam_width=128, max_tokens=3, ignore_eos=True), frozenset({0})
    )
    rng = random.Random(1)
    search.advance(round_outputs(search, rng, vocab=50_000))
    search.advance(round_outputs(search, rng, vocab=50_000))  # 128 beams x 256 candidates
    built.clear()
    search.advance(round_outputs(search, rng, vocab=50_000))
    assert len(search.beams) == 128 and len(built) <= 129


def test_logprob_texts_are_decoded_once_per_token(tiny_llama_llm):
    from tokenmill import SamplingParams

    proc = tiny_llama_llm.engine.output_processor
    calls = []
    decode = proc.tokenizer.decode

    def counting(ids, **kw):
        calls.append(tuple(ids))
        return decode(ids, **kw)

    proc._token_text.clear()
    proc.tokenizer.decode = counting
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
        outs = tiny_llama_llm.generate(["Hello there"] * 6, params)
    finally:
        del proc.tokenizer.decode
    texts = [{t: lp.decoded_token for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    assert all(t == texts[0] for t in texts) and len(texts[0]) >= 20
    single = [c for c in calls if len(c) == 1]
    assert len(single) == len(set(single))  # 6 requests x 21 entries, each token decoded once
