"""Sampler, stop conditions, seeds and input validation."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from tokenmill import LLM, SamplingParams
from tokenmill.request import Request
from tokenmill.sample.sampler import Sampler, SamplingBatch, SamplingBatches


def _batch(logits_rows, **params):
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(**params)) for i in range(len(logits_rows))]
    return torch.tensor(logits_rows, dtype=torch.float32), SamplingBatch.from_requests(reqs, len(logits_rows[0])), reqs


def test_greedy_is_argmax_and_truncation_keeps_top():
    logits, batch, _ = _batch([[0.1, 3.0, 2.9, -1.0]] * 4, temperature=0.0)
    assert Sampler()(logits, batch).token_ids == [1, 1, 1, 1]
    for kw in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 0.99}):
        logits, batch, _ = _batch([[0.1, 3.0, 2.9, -1.0]] * 64, temperature=1.5, **kw)
        assert set(Sampler()(logits, batch).token_ids) == {1}, kw


def test_sampling_distribution_follows_temperature():
    logits = [[0.0, 1.0]] * 4000
    l, b, _ = _batch(logits, temperature=1.0)
    frac = sum(Sampler(1)(l, b).token_ids) / 4000
    assert abs(frac - torch.sigmoid(torch.tensor(1.0)).item()) < 0.03
    l, b, _ = _batch(logits, temperature=0.25)
    frac = sum(Sampler(1)(l, b).token_ids) / 4000
    assert abs(frac - torch.sigmoid(torch.tensor(4.0)).item()) < 0.03


def test_sampled_tokens_follow_the_distribution_over_a_large_vocab():
    """Inverse-CDF draws over a vocab of several CDF blocks (ragged last block): token counts
    match softmax(logits / T) restricted to the top k (chi-square, 6,000 draws from a fixed seed,
    so the outcome is fixed), and tokens outside the top k are never drawn."""
    from tokenmill.sample.sampler import CDF_BLOCK

    V, n, k = 3 * CDF_BLOCK + 37, 6000, 40
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5)) * 2.0
    l, b, _ = _batch([logits.tolist()] * n, temperature=0.7, top_k=k)
    counts = torch.bincount(torch.tensor(Sampler(7)(l, b).token_ids), minlength=V).double()
    top = torch.topk(logits, k).indices
    outside = torch.ones(V, dtype=torch.bool)
    outside[top] = False
    assert counts[outside].sum() == 0
    expected = torch.softmax(logits[top] / 0.7, dim=0).double() * n
    keep = expected >= 5  # chi-square's rule of thumb; the rest pooled into one cell
    obs = torch.cat([counts[top][keep], counts[top][~keep].sum().unsqueeze(0)])
    exp = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    chi2 = float(((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum())
    dof = int(keep.sum())  # cells - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~5 sigma above the mean


def _reference_cut(row: torch.Tensor, k: int, p: float) -> float:
    """The smallest logit top-k then top-p keep, by sorting (float64): tokens are kept while the
    mass before them is below p, and every token tied with the last one kept stays."""
    V, cut = row.numel(), float("-inf")
    w = (row.double() - row.max()).exp()
    order = row.sort(descending=True).indices
    if k < V:
        cut = float(row[order[k - 1]])
    if p < 1.0:
        kept = order[row[order] >= cut]
        cum = w[kept].cumsum(0)
        hit = (cum >= p * float(w[row >= cut].sum())).nonzero()
        cut = max(cut, float(row[kept[hit[0, 0]]]) if hit.numel() else cut)
    return cut


@pytest.mark.parametrize("scale", [0.3, 3.0, 40.0])
def test_top_k_top_p_kernel_cuts_where_a_sort_would(scale):
    """csrc/sampling.cpp keeps in every row exactly the tokens at or above the sorted reference's
    cut: flat and peaked rows (at scale 40 most tokens fall below the kernel's last bin, 33 under
    the max), ties (logits rounded to bfloat16), -inf tokens and a row of them, k of 1, beyond the
    tokens within 33 of the max, and V (no cut), p of 0 and 1 (no cut), top-k alone, top-p alone
    and both; the kept logits unchanged."""
    from tokenmill.kernels import cpu_kernels
    from tokenmill.sample.sampler import _top_k_top_p

    if cpu_kernels.load() is None:
        pytest.skip("no C++ kernels")
    g = torch.Generator().manual_seed(int(scale * 10))
    R, V = 24, 3001
    logits = (torch.randn(R, V, generator=g) * scale).bfloat16().float()
    logits[3, ::7] = float("-inf")
    logits[7] = float("-inf")
    k = torch.randint(1, 400, (R,), generator=g)
    k[0], k[1], k[2], k[4] = 1, V, V + 5, 2900
    p = torch.rand(R, generator=g)
    p[0], p[1], p[6] = 0.0, 1.0, 0.999
    for top_k, top_p in ((k, None), (None, p), (k, p)):
        out = _top_k_top_p(logits, top_k, top_p, cpu_kernels.load())
        for r in range(R):
            if r == 7:
                assert torch.isneginf(out[r]).all()
                continue
            cut = _reference_cut(
                logits[r], int(top_k[r]) if top_k is not None else V, float(top_p[r]) if top_p is not None else 1.0
            )
            kept = torch.isfinite(out[r])
            assert torch.equal(kept, (logits[r] >= cut) & torch.isfinite(logits[r])), (r, top_k is None, top_p is None)
            assert torch.equal(out[r][kept], logits[r][kept])


def test_top_p_cuts_the_tail():
    # probs ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two only.
    l, b, _ = _batch([[3.0, 2.0, 1.0, 0.0]] * 2000, temperature=1.0, top_p=0.8)
    assert set(Sampler(2)(l, b).token_ids) == {0, 1}


def test_penalties():
    reqs = [Request("r", [1, 1, 2], SamplingParams(temperature=0.0, repetition_penalty=2.0))]
    reqs[0].append_output_token(0)
    logits = torch.tensor([[2.0, 1.9, -0.1, 0.5]])
    # Seen tokens 0, 1, 2: 2.0 -> 1.0, 1.9 -> 0.95, -0.1 -> -0.2; unseen 0.5 stays.
    assert Sampler()(logits, SamplingBatch.from_requests(reqs, 4)).token_ids == [0]
    logits = torch.tensor([[2.0, 1.9, -0.1, 1.2]])
    assert Sampler()(logits, SamplingBatch.from_requests(reqs, 4)).token_ids == [3]
    reqs = [Request("r", [3], SamplingParams(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5))]
    for t in (0, 0):
        reqs[0].append_output_token(t)
    # Token 0: 2.0 - 2*1.0 - 0.5 = -0.5 < token 1's 1.0. The prompt token 3 is not penalised.
    logits = torch.tensor([[2.0, 1.0, 0.0, 1.5]])
    assert Sampler()(logits, SamplingBatch.from_requests(reqs, 4)).token_ids == [3]


def test_min_tokens_blocks_eos_and_stop_ids():
    req = Request(
        "r", [1], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]), eos_token_ids=frozenset({0})
    )
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    assert Sampler()(logits, SamplingBatch.from_requests([req], 4)).token_ids == [1]


def test_sampling_batches_reused_only_while_nothing_follows_the_output():
    """The runner's SamplingBatches hands the last batch back for the same requests unless it
    depends on their output so far: min_tokens bans lift, bad words and penalties follow it."""
    cpu = torch.device("cpu")
    plain = Request("a", [1], SamplingParams(temperature=0.7, top_p=0.9, logprobs=1, seed=3))
    other = Request("b", [1], SamplingParams(temperature=0.0))
    batches = SamplingBatches()
    first = batches([plain, other], 4, cpu)
    plain.append_output_token(2)
    assert batches([plain, other], 4, cpu) is first
    assert batches([other, plain], 4, cpu) is not first and batches([other], 4, cpu).all_greedy
    banned = Request("c", [1], SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[2]))
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0]])
    assert Sampler()(logits, batches([banned], 4, cpu)).token_ids == [1]
    banned.append_output_token(1)  # min_tokens reached: 2 may be sampled now
    assert Sampler()(logits, batches([banned], 4, cpu)).token_ids == [2]
    for params, bad_words in (({"bad_words": ["x"]}, [[3]]), ({"repetition_penalty": 1.5}, [])):
        req = Request("d", [1], SamplingParams(temperature=0.0, **params), bad_words_token_ids=bad_words)
        assert batches([req], 4, cpu) is not batches([req], 4, cpu)


def test_logprobs_topn_and_rank():
    l, b, _ = _batch([[0.0, 3.0, 2.0, 1.0]], temperature=0.0, logprobs=2)
    out = Sampler()(l, b)
    lp = out.logprobs[0]
    ref = torch.log_softmax(l[0], -1)
    assert lp.rank == 1 and abs(lp.token_logprob - ref[1].item()) < 1e-6
    assert [t for t, _ in lp.top] == [1, 2]


def test_seeded_sampling_reproducible_alone_and_in_batch(tiny_llama_llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = tiny_llama_llm.generate("Hello world", p)[0].outputs[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * (len(PROMPTS))
    outs = tiny_llama_llm.generate(PROMPTS + ["Hello world"], others + [p])
    assert outs[-1].outputs[0].text == alone.text and outs[-1].outputs[0].token_ids == alone.token_ids
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24, ignore_eos=True)
    assert tiny_llama_llm.generate("Hello world", other_seed)[0].outputs[0].token_ids != alone.token_ids


def test_stop_strings_and_tokens(tiny_llama_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    full = tiny_llama_llm.generate("Hello world, the quick", greedy)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 32
    text = full.text
    # A stop string spanning a token boundary: take 3 characters from the middle of the text.
    stop = text[5:8]
    assert len(stop) == 3
    out = tiny_llama_llm.generate(
        "Hello world, the quick", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    # Streaming never emits any part of the stop string.
    streamed = "".join(
        o.outputs[0].delta_text
        for o in tiny_llama_llm.stream(
            "Hello world, the quick", SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
        )
    )
    assert streamed == out.text
    tok = full.token_ids[3]
    out = tiny_llama_llm.generate(
        "Hello world, the quick", SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[tok])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids == full.token_ids[:4]


def test_eos_stops_unless_ignored(tiny_llama_llm):
    eng = tiny_llama_llm.engine
    full = tiny_llama_llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    first = full[0].outputs[0].token_ids[0]
    eng.eos_token_ids = frozenset({first})  # pretend the first greedy token is EOS
    try:
        out = tiny_llama_llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids == [first]
        out = tiny_llama_llm.generate("Hello world", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3))[0]
        assert first not in out.outputs[0].token_ids[:3]
    finally:
        eng.eos_token_ids = _orig_eos(tiny_llama_llm)


def _orig_eos(llm):
    from tokenmill.engine.llm_engine import _eos_ids

    return _eos_ids(llm.engine.config.model.path, llm.engine.tokenizer, llm.engine.config.model.hf_config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_llama_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_llama_llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        tiny_llama_llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="context length"):
        tiny_llama_llm.generate(prompt_token_ids=[[5] * 600])
    with pytest.raises(ValueError, match="token ids"):
        tiny_llama_llm.generate(prompt_token_ids=[[10**7]])
    assert not tiny_llama_llm.engine.core.scheduler.requests


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/folder")


def test_unknown_architecture(tmp_path, tiny_llama_dir):
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(str(d))


def test_max_tokens_capped_by_context(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=20, kv_cache_memory=0.01)
    ids = llm.get_tokenizer().encode("Hello world, the quick")
    out = llm.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    )
    assert out[0].outputs[0].finish_reason == "length"
    assert len(ids) + len(out[0].outputs[0].token_ids) == 20


def test_stop_token_ids_out_of_vocab(tiny_llama_llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llama_llm.generate("Hello", SamplingParams(stop_token_ids=[10**6], min_tokens=2))


def test_n_and_best_of_offline(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01)
    prompt = "Samples share the prompt's blocks: " * 4
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(prompt, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Sample i is the n=1 request with seed + i.
    for i, c in enumerate(out.outputs):
        alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8, ignore_eos=True))
        assert alone[0].outputs[0].token_ids == c.token_ids
    kv = llm.engine.core.kv
    bs = llm.engine.config.cache.block_size
    hits0 = kv.stats.hits
    llm.generate("A fresh prompt that nobody has sent before, long enough for a block or two.", params)
    n_prompt = len(
        llm.get_tokenizer().encode("A fresh prompt that nobody has sent before, long enough for a block or two.")
    )
    assert kv.stats.hits - hits0 == 3 * ((n_prompt - 1) // bs * bs)  # samples 2-4 reuse sample 1's blocks
    (best,) = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=8, logprobs=0))
    assert len(best.outputs) == 2 and best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    assert kv.num_free_blocks == kv.num_usable_blocks
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="one request per sample"):
        next(llm.stream(prompt, params))
