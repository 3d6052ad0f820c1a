"""Greedy outputs and logprobs equal Hugging Face transformers', alone and in a continuous batch."""

from __future__ import annotations

import pytest
from conftest import PROMPTS
from hf_oracle import hf_greedy, matching_prefix

from tokenmill import SamplingParams

MAX_TOKENS = 32


def _greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _prompt_ids(llm, prompts):
    return [llm.get_tokenizer().encode(p) for p in prompts]


def _run_staggered(engine, prompt_ids, params, gap=3):
    """Add prompt i after i*gap engine steps, so requests join a batch already decoding."""
    pending = list(enumerate(prompt_ids))
    rid_to_idx, results, step = {}, {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * gap:
            i, ids = pending.pop(0)
            rid_to_idx[engine.add_request(None, ids, params)] = i
        for out in engine.step():
            if out.finished:
                results[rid_to_idx[out.request_id]] = out
        step += 1
    return [results[i] for i in range(len(prompt_ids))]


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_qwen2", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_tiny_models_match_hf(which, request):
    model_dir = request.getfixturevalue(f"{which}_dir")
    llm = request.getfixturevalue(f"{which}_llm")
    ids = _prompt_ids(llm, PROMPTS)
    expected = [hf_greedy(model_dir, p, MAX_TOKENS) for p in ids]
    # Each prompt alone.
    for p, exp in zip(ids, expected):
        matching_prefix(llm.generate(prompt_token_ids=[p], sampling_params=_greedy())[0].outputs[0].token_ids, exp)
    # All at once, one continuous batch of different lengths.
    outs = llm.generate(prompt_token_ids=ids, sampling_params=_greedy(logprobs=0))
    for out, exp in zip(outs, expected):
        n = matching_prefix(out.outputs[0].token_ids, exp)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[: n + 1]]
        assert max(abs(a - b) for a, b in zip(got, exp[1])) < 1e-3
    # Staggered arrivals.
    for out, exp in zip(_run_staggered(llm.engine, ids, _greedy()), expected):
        matching_prefix(out.outputs[0].token_ids, exp)
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_gguf_and_hf_folder_give_same_logits(tiny_llama_dir, tiny_llama_llm, tmp_path, monkeypatch):
    from gguf_writer import write_gguf_from_hf

    from tokenmill import LLM

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_gguf_from_hf(tiny_llama_dir, tmp_path / "tiny.gguf")
    from_gguf = LLM(str(gguf_file), dtype="float32", kv_cache_memory=0.01)
    params = _greedy(max_tokens=16, logprobs=5)
    for prompt in PROMPTS[:4]:
        a = tiny_llama_llm.generate(prompt, params)[0].outputs[0]
        b = from_gguf.generate(prompt, params)[0].outputs[0]
        assert a.token_ids == b.token_ids and a.text == b.text
        for da, db in zip(a.logprobs, b.logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t].logprob - db[t].logprob) < 1e-5 for t in da)


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_logprobs_match_hf(tiny_llama_dir, chunk):
    import torch
    from hf_oracle import load_hf

    from tokenmill import LLM

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=chunk)
    ids = _prompt_ids(llm, PROMPTS)
    # Twice: the second round's prompts are in the prefix cache, which prompt logprobs must bypass.
    for _ in range(2):
        outs = llm.generate(prompt_token_ids=ids, sampling_params=_greedy(max_tokens=2, prompt_logprobs=3))
        for p, out in zip(ids, outs):
            with torch.no_grad():
                ref = torch.log_softmax(load_hf(tiny_llama_dir)(torch.tensor([p])).logits[0].float(), -1)
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            for i in range(1, len(p)):
                step = out.prompt_logprobs[i]
                assert abs(step[p[i]].logprob - float(ref[i - 1, p[i]])) < 1e-4
                top = sorted((lp for lp in step.values() if lp.rank <= 3), key=lambda lp: lp.rank)
                want = ref[i - 1].topk(3).values.tolist()
                assert len(top) == 3 and all(abs(lp.logprob - v) < 1e-4 for lp, v in zip(top, want))
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_beam_search_matches_hf(tiny_llama_dir, tiny_llama_llm):
    import torch
    from hf_oracle import load_hf

    from tokenmill.beam_search import BeamSearchParams

    ids = _prompt_ids(tiny_llama_llm, PROMPTS[:3])
    outs = tiny_llama_llm.beam_search(
        ids, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=0.0)
    )
    for p, out in zip(ids, outs):
        g = load_hf(tiny_llama_dir).generate(
            torch.tensor([p]),
            num_beams=3,
            num_return_sequences=3,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            length_penalty=0.0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert [s.output_tokens for s in out.sequences] == [t[len(p) :].tolist() for t in g.sequences]
        assert all(abs(s.cum_logprob - h) < 1e-3 for s, h in zip(out.sequences, g.sequences_scores.tolist()))
    kv = tiny_llama_llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks
