"""Speculative decoding with a draft model (spec_decode/draft_model.py): its own weights, dtype,
quantization, KV cache and block pool; drafts never change what is generated.

Drafts: the target itself (every greedy draft accepted), the target with its own int8 weights in
bfloat16 (close but not equal), and a 1-layer qwen2 with the same tokenizer (mostly rejected).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from tiny_models import build_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import GuidedDecodingParams

PROMPTS = [[1, 5, 9, 33, 7] * 6, [3, 4, 5] * 20, list(range(2, 40)) * 2, [11, 12] * 3, list(range(100, 200))]


def _greedy(n: int = 20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _spec(draft: str, k: int = 3, **kw) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, **kw}


def _tokens(llm: LLM, prompts=PROMPTS, params=None):
    res = llm.generate(prompt_token_ids=prompts, sampling_params=params or _greedy(logprobs=2), use_tqdm=False)
    return [o.outputs[0].token_ids for o in res], res


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), "qwen2", seed=1, num_hidden_layers=1))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)
    out = _tokens(llm)
    llm.shutdown()
    return out


def _check_no_leaks(llm: LLM) -> None:
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks
    pool = core.drafter.proposer.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "the draft's blocks are freed with their requests"


@pytest.mark.parametrize("draft", ["self", "self-int8-bf16", "small"])
def test_greedy_equals_no_speculation(tiny_llama_dir, small_draft_dir, reference, draft):
    """Chunked prefill of 8 tokens (the draft catches up on a 100-token prompt over several steps),
    an 18-block pool of 8-token blocks (preemptions), and a second round served from the prefix cache."""
    spec = {
        "self": _spec(tiny_llama_dir),
        "small": _spec(small_draft_dir),
        "self-int8-bf16": _spec(tiny_llama_dir, quantization="int8", dtype="bfloat16"),
    }[draft]
    llm = LLM(
        tiny_llama_dir,
        dtype="float32",
        speculative_config=spec,
        num_gpu_blocks_override=18,
        block_size=8,
        max_num_batched_tokens=8,
        max_num_seqs=4,
    )
    ref_tokens, ref_res = reference
    for _ in range(2):
        tokens, res = _tokens(llm)
        assert tokens == ref_tokens
        for a, b in zip(res, ref_res):
            for lp, ref_lp in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert lp.keys() == ref_lp.keys()
                assert all(abs(lp[t].logprob - ref_lp[t].logprob) < 1e-4 for t in lp)
    core = llm.engine.core
    stats = core.drafter.stats
    assert core.scheduler.num_preemptions > 0 and core.kv.stats.hits > 0
    assert stats.num_draft_tokens > 0
    if draft == "self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the target drafting for itself
    elif draft == "self-int8-bf16":
        assert stats.acceptance_rate > 0.5
    _check_no_leaks(llm)
    llm.shutdown()


def test_structured_output_stop_strings_and_n(tiny_llama_dir, small_draft_dir):
    """A regex grammar (drafts cut where the grammar forbids them), a stop token, and n=2 seeded
    samples: the same outputs as without speculation."""
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, guided_decoding=GuidedDecodingParams(regex="[a-d]{3,9}")),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(max_tokens=10, temperature=0.8, n=2, seed=3, ignore_eos=True),
    ]
    prompts = [[11, 12] * 3, [3, 4, 5] * 20, [1, 5, 9, 33, 7] * 6]

    def run(**kw):
        llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, max_num_seqs=8, **kw)
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [[c.token_ids for c in r.outputs] for r in res], llm

    ref, _ = run()
    for draft in (tiny_llama_dir, small_draft_dir):
        got, llm = run(speculative_config=_spec(draft))
        assert got[:2] == ref[:2]
        assert [len(t) for t in got[2]] == [10, 10]
        assert llm.engine.core.drafter.stats.num_draft_tokens > 0
        _check_no_leaks(llm)
        llm.shutdown()


def test_sampled_drafts_draw_the_target_distribution(tiny_llama_dir):
    """Seeded sampling at top_k=5: the draft (the target with its own int4 weights in bfloat16, so
    q is near p but not equal) samples its drafts and verification sees their q; tokens 2 to 4 of 1200 requests must follow
    the same distribution as without speculation (two-sample chi-square at p = 0.001; fixed seeds,
    so the test is deterministic). Emitting a plain sample of p at a rejection instead of one of
    norm(max(p - q, 0)) moves mass towards the draft's favourites and fails it."""
    n = 1200
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=5, seed=i, ignore_eos=True) for i in range(n)]
    prompt = [[1, 5, 9, 33, 7, 2]] * n

    def histograms(**kw):
        llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, max_num_seqs=8, **kw)
        res = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
        toks = [r.outputs[0].token_ids for r in res]
        return [Counter(t[j] for t in toks) for j in (1, 2, 3)], llm

    ref, _ = histograms()
    got, llm = histograms(speculative_config=_spec(tiny_llama_dir, k=2, quantization="int4", dtype="bfloat16"))
    stats = llm.engine.core.drafter.stats
    assert stats.num_draft_tokens > n and 0.2 < stats.acceptance_rate < 0.95  # both paths taken often
    for a, b in zip(ref, got):
        stat, crit = _chi2_two_sample(a, b)
        assert stat < crit
    llm.shutdown()


def _chi2_two_sample(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, float]:
    """Two-sample chi-square statistic over the tokens seen (those seen fewer than min_count times in
    both samples together pooled into one bin) and its critical value at p = 0.001 (Wilson-Hilferty)."""
    na, nb = sum(a.values()), sum(b.values())
    bins: list[tuple[int, int]] = []
    rest = [0, 0]
    for t in set(a) | set(b):
        if a[t] + b[t] >= min_count:
            bins.append((a[t], b[t]))
        else:
            rest[0] += a[t]
            rest[1] += b[t]
    if sum(rest):
        bins.append((rest[0], rest[1]))
    stat = sum((x * (nb / na) ** 0.5 - y * (na / nb) ** 0.5) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    crit = df * (1 - 2 / (9 * df) + 3.090 * (2 / (9 * df)) ** 0.5) ** 3
    return stat, crit


def test_bad_draft_models_are_refused(tiny_llama_dir, tmp_path):
    other_vocab = build_tiny_model(tmp_path / "vocab", "llama", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary of 600 tokens"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, speculative_config=_spec(str(other_vocab)))
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_llama_dir, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs from the target's on 2 tokens"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, speculative_config=_spec(str(swapped)))
    with pytest.raises(ValueError, match="quantization"):
        LLM(
            tiny_llama_dir,
            dtype="float32",
            kv_cache_memory=0.05,
            speculative_config=_spec(tiny_llama_dir, quantization="fp3"),
        )
    assert Path(tiny_llama_dir).exists()
