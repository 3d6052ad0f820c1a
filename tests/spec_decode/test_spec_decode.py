"""Speculative decoding in the engine: drafts never change what is generated.

The tiny random models rarely repeat themselves, so besides the real n-gram proposer most tests
plug in an "oracle" that drafts the true greedy continuation for some requests and wrong tokens
for others: every path (all accepted, rejected at each position, none) runs, and the output must
equal the run without speculation token for token. float32: the rounding differences between a
multi-token verification chunk and single decode steps are too small to flip a token. bfloat16:
the batch-invariant path (tests/engine/test_batch_invariance.py) gives each row the same bits in a
verification chunk as in a decode step, whatever else the step holds, so the bf16 tests compare
with the bf16 engine without speculation (and their logprobs must be equal, not close).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import record_multi_row_fused_steps

from tokenmill import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 7] * 6, [3, 4, 5] * 20, list(range(2, 40)) * 2, [11, 12] * 3]
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})


def _greedy(n: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


class Oracle:
    """Drafts the reference continuation of each prompt (`truth`), corrupted at position
    (request index % 5) for a request's every other step, so rejections land at every position."""

    def __init__(self, truth: dict[tuple, list[int]], vocab: int):
        self.truth, self.vocab, self.calls = truth, vocab, 0

    def propose(self, req, k: int) -> list[int]:
        self.calls += 1
        ref = self.truth.get(tuple(req.prompt_token_ids))
        if ref is None:  # a prompt without a reference: a wrong draft
            return [(req.all_token_ids[-1] + 1) % self.vocab]
        done = req.num_output_tokens
        drafts = list(ref[done : done + k])
        bad = hash(tuple(req.prompt_token_ids)) % 5
        if self.calls % 2 and bad < len(drafts):
            drafts[bad] = (drafts[bad] + 1) % self.vocab
        return drafts

    def add_tokens(self, req, tokens):
        pass

    def finish(self, req):
        pass


def _run(llm: LLM, prompts=PROMPTS, params=None):
    res = llm.generate(prompt_token_ids=prompts, sampling_params=params or _greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in res], res


DTYPES = ["float32", "bfloat16"]


def _require_invariant(llm: LLM) -> None:
    """bf16 speculation equals no speculation only where the bf16 path is batch-invariant: the
    attention rows kernel and every linear in panels (the C++ kernels with AVX512-BF16 or AVX2 + FMA)."""
    from tokenmill.model.layers.linear import PackedLinear

    runner = llm.engine.core.runner
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    if not (
        getattr(runner.attn, "batch_invariant", False) and linears and all(m.packed_weight is None for m in linears)
    ):
        pytest.skip("the bf16 path is not batch-invariant here (needs the C++ kernels with AVX512-BF16 or AVX2 + FMA)")


@pytest.fixture(scope="module")
def references(tiny_llama_dir):
    """references(dtype): the engine without speculation, greedy with logprobs, per dtype (cached)."""
    cache = {}

    def get(dtype: str):
        if dtype not in cache:
            llm = LLM(tiny_llama_dir, dtype=dtype, kv_cache_memory=0.05)
            if dtype == "bfloat16":
                _require_invariant(llm)
            cache[dtype] = _run(llm, params=_greedy(logprobs=2))
            llm.shutdown()
        return cache[dtype]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references("float32")


def _spec_llm(model_dir: str, oracle_truth=None, dtype: str = "float32", **kw) -> LLM:
    llm = LLM(model_dir, dtype=dtype, speculative_config=kw.pop("speculative_config", NGRAM), **kw)
    if oracle_truth is not None:
        llm.engine.core.drafter.proposer = Oracle(oracle_truth, llm.engine.config.model.vocab_size)
    return llm


@pytest.mark.parametrize("dtype", DTYPES)
def test_ngram_greedy_equals_no_speculation(tiny_llama_dir, references, dtype):
    reference = references(dtype)
    llm = _spec_llm(tiny_llama_dir, dtype=dtype, kv_cache_memory=0.05)
    assert _run(llm)[0] == reference[0]
    assert llm.engine.core.drafter.stats.num_draft_tokens > 0
    llm.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_suffix_drafts_from_an_earlier_output(tiny_llama_dir, references, dtype):
    """suffix: the same prompt again is drafted from the first answer (the global tree), every
    draft accepted after the first tokens; tokens equal the unspeculated ones both times."""
    reference = references(dtype)
    llm = _spec_llm(
        tiny_llama_dir,
        dtype=dtype,
        kv_cache_memory=0.05,
        speculative_config={"method": "suffix", "num_speculative_tokens": 4},
    )
    st = llm.engine.core.drafter.stats
    assert _run(llm, PROMPTS[:1])[0] == reference[0][:1]
    before = st.num_accepted_tokens
    assert _run(llm, PROMPTS[:1])[0] == reference[0][:1]
    assert st.num_accepted_tokens - before >= len(reference[0][0]) // 2
    llm.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
def test_oracle_drafts_accepted_and_rejected_at_every_position(tiny_llama_dir, references, dtype):
    reference = references(dtype)
    truth = {tuple(p): t for p, t in zip(PROMPTS, reference[0])}
    llm = _spec_llm(tiny_llama_dir, truth, dtype=dtype, kv_cache_memory=0.05)
    tokens, res = _run(llm, params=_greedy(logprobs=2))
    assert tokens == reference[0]
    for got, want in zip(res, reference[1]):  # logprobs of every emitted token, accepted drafts included
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            for t in a:  # bf16: the same logits bits, so the same logprobs
                want_lp = pytest.approx(b[t].logprob, abs=1e-4) if dtype == "float32" else b[t].logprob
                assert a[t].logprob == want_lp
    st = llm.engine.core.drafter.stats
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_draft_tokens
    assert all(n > 0 for n in st.accepted_per_pos)
    assert st.accepted_per_pos == sorted(st.accepted_per_pos, reverse=True)
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks  # nothing leaked by rollbacks
    llm.shutdown()


def test_chunked_prefill_preemption_prefix_caching(tiny_llama_dir, reference):
    """8-token prompt chunks, a pool so small that requests preempt each other, then the same
    prompts again (prefix-cache hits): the same tokens, and every block back in the pool."""
    truth = {tuple(p): t for p, t in zip(PROMPTS, reference[0])}
    llm = _spec_llm(
        tiny_llama_dir, truth, num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=8, max_model_len=128
    )
    assert _run(llm)[0] == reference[0]
    assert _run(llm)[0] == reference[0]
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0 and core.kv.stats.hits > 0
    assert core.drafter.stats.num_accepted_tokens > 0
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks
    llm.shutdown()


def test_stop_strings_max_tokens_n_and_penalties(tiny_llama_dir):
    """Stop tokens inside an accepted run end the output where decoding one by one would; n=2
    and penalties (which see the drafts before each position) give the unspeculated tokens."""
    plain = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)
    ref = _run(plain, params=_greedy(30))[0]
    params = [
        _greedy(30, stop_token_ids=[ref[0][7]]),
        _greedy(9),
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        ),
        SamplingParams(max_tokens=16, n=2, temperature=0.8, seed=7, ignore_eos=True),
    ]
    want = [
        [o.token_ids for o in r.outputs]
        for p in params
        for r in plain.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    ]
    plain.shutdown()
    truth = {tuple(p): t for p, t in zip(PROMPTS, ref)}
    llm = _spec_llm(tiny_llama_dir, truth, kv_cache_memory=0.05)
    got = [
        [o.token_ids for o in r.outputs]
        for p in params
        for r in llm.generate(prompt_token_ids=PROMPTS, sampling_params=p, use_tqdm=False)
    ]
    n_greedy = 3 * len(PROMPTS)
    assert got[:n_greedy] == want[:n_greedy]
    assert got[0][0] == ref[0][:8]  # stopped at the stop token, which an accepted draft carried
    for g in got[n_greedy:]:  # sampled: lengths only (the draws differ with speculation)
        assert [len(x) for x in g] == [16, 16]
    llm.shutdown()


def test_structured_output_checks_each_draft_position(tiny_llama_dir):
    """A regex grammar: drafts the grammar forbids are cut before verification, the accepted
    ones advance the matcher, and the output equals the unspeculated one (and matches)."""
    import re

    from tokenmill.sampling_params import GuidedDecodingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{4,40}"))
    plain = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05)
    want_res = plain.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in want_res]
    plain.shutdown()
    truth = {tuple(p): t for p, t in zip(PROMPTS, want)}
    llm = _spec_llm(tiny_llama_dir, truth, kv_cache_memory=0.05)
    res = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in res] == want
    for o in res:
        assert re.fullmatch(r"[a-z ]{4,40}", o.outputs[0].text), o.outputs[0].text
    assert llm.engine.core.drafter.stats.num_accepted_tokens > 0
    llm.shutdown()


def test_bf16_chunked_preempted_cached_structured_stop_string_n2(tiny_llama_dir, references):
    """bf16, one mixed batch: a stop string, a regex grammar, n=2 and plain greedy requests, with
    oracle drafts, 8-token steps (prompt chunks), a pool so small that requests preempt each other,
    then the same requests again (prefix-cache hits). The reference is the bf16 engine without
    speculation, whole prompts in one step and nothing preempted: the same tokens, text and
    logprobs (bit for bit), and every block back in the pool."""
    import re

    from tokenmill.sampling_params import GuidedDecodingParams

    ref_tokens, ref_res = references("bfloat16")
    text = ref_res[0].outputs[0].text
    stop = re.search(r"[a-z]{2}", text[len(text) // 3 :])  # a stop string that occurs mid-output
    assert stop, text
    stop = stop.group()
    params = [
        _greedy(logprobs=2, stop=[stop]),
        SamplingParams(
            max_tokens=24, temperature=0.0, logprobs=2, guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{4,40}")
        ),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, n=2),
        _greedy(logprobs=2),
    ]
    shape = dict(dtype="bfloat16", block_size=8, max_model_len=128)

    def outputs(res):
        return [
            [
                (o.token_ids, o.text, o.finish_reason, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs])
                for o in r.outputs
            ]
            for r in res
        ]

    plain = LLM(tiny_llama_dir, kv_cache_memory=0.05, **shape)
    want_res = plain.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    assert plain.engine.core.scheduler.num_preemptions == 0
    plain.shutdown()
    want = outputs(want_res)
    assert want[0][0][2] == "stop" and len(want[0][0][0]) < len(ref_tokens[0])  # the stop string ended it
    assert re.fullmatch(r"[a-z ]{4,40}", want[1][0][1]), want[1][0][1]
    assert want[2][0] == want[2][1]
    assert [w[0][0] for w in want[2:]] == ref_tokens[2:]
    # the oracle drafts each request's unstopped greedy continuation (the grammar's for the regex)
    truth = {tuple(p): t for p, t in zip(PROMPTS, ref_tokens)}
    truth[tuple(PROMPTS[1])] = want[1][0][0]
    llm = _spec_llm(tiny_llama_dir, truth, num_gpu_blocks_override=14, max_num_batched_tokens=8, **shape)
    _require_invariant(llm)
    fd = llm.engine.core.runner.fast_decode
    multi = record_multi_row_fused_steps(llm)  # the steps of verification / prompt chunks it runs fused
    for _ in range(2):
        assert outputs(llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)) == want
    core = llm.engine.core
    assert fd is None or multi, "no multi-row step ran fused"
    assert core.scheduler.num_preemptions > 0 and core.kv.stats.hits > 0
    st = core.drafter.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks
    llm.shutdown()


def test_rejection_sampling_draws_the_target_distribution():
    """verify_drafts on fixed logits, 20,000 requests at once, each with drafts (d0, d1): the
    first emitted token is distributed as p0, and after an accepted d0 the next as p1
    (chi-square against fixed critical values; the sampler's seed is fixed, so this cannot flake)."""
    from tokenmill.request import Request
    from tokenmill.sample.sampler import Sampler
    from tokenmill.sample.verify import verify_drafts
    from tokenmill.step import ScheduledRequest

    V, N = 6, 20000
    p0 = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.15, 0.1])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.2, 0.25, 0.15])
    p2 = torch.full((V,), 1 / V)
    rows = torch.stack([p0, p1, p2]).log().repeat(N, 1)
    params = SamplingParams(max_tokens=8, temperature=1.0)
    scheduled = []
    for i in range(N):
        req = Request(str(i), [1, 2], params)
        scheduled.append(ScheduledRequest(req, 3, [], [1, 3]))  # d0 = 1 (p 0.4), d1 = 3 (p 0.2)
    out = verify_drafts(Sampler(seed=1234), rows.float(), scheduled)
    first = torch.tensor([(out.accepted_ids[i] + [out.token_ids[i]])[0] for i in range(N)])
    after_d0 = torch.tensor([(out.accepted_ids[i] + [out.token_ids[i]])[1] for i in range(N) if out.accepted_ids[i]])

    def chi2(samples, p):
        counts = torch.bincount(samples, minlength=V).float()
        expected = p * len(samples)
        return float(((counts - expected) ** 2 / expected).sum())

    crit = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi2(first, p0) < crit
    assert len(after_d0) == pytest.approx(0.4 * N, rel=0.05)
    assert chi2(after_d0, p1) < crit
    # The test can fail: a verifier that always accepts would give first == 1 everywhere.
    assert (first == 1).float().mean() == pytest.approx(0.4, abs=0.02)


def test_bad_speculative_config_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown method"):
        LLM(tiny_llama_dir, dtype="float32", speculative_config='{"method": "medusa", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_llama_dir, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    # draft models that cannot serve as one: tests/spec_decode/test_spec_decode_draft.py


def test_server_streams_verified_runs_and_reports_metrics(tiny_llama_dir, reference):
    """Streamed completions (several tokens per step) equal the offline text; /metrics carries
    vLLM's spec-decode counters and `tokenmill bench serve` reports acceptance from them."""
    import asyncio

    import httpx
    import openai
    from conftest import running_server

    from tokenmill.bench.datasets import load_tokenizer, random_requests
    from tokenmill.bench.serve import benchmark, format_report

    truth = {tuple(p): t for p, t in zip(PROMPTS, reference[0])}
    with running_server(tiny_llama_dir, speculative_config=NGRAM) as (server, aengine):
        aengine.engine.core.drafter.proposer = Oracle(truth, aengine.engine.config.model.vocab_size)
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for prompt, want in zip(PROMPTS[:2], reference[1]):
                stream = client.completions.create(
                    model=aengine.engine.config.model.name,
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                assert "".join(c.choices[0].text for c in stream) == want.outputs[0].text
        text = httpx.get(server.url + "/metrics").text
        accepted = [
            line for line in text.splitlines() if line.startswith("tokenmill:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and float(accepted[0].split()[-1]) > 0
        assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
        reqs = random_requests(load_tokenizer(tiny_llama_dir), 4, 16, 8, seed=0)
        result = asyncio.run(benchmark(server.url, reqs, disable_tqdm=True))
        sd = result["metrics"]["spec_decode"]  # the Oracle's wrong drafts: all rejected
        assert sd["draft_tokens"] > 0 and sd["accepted_tokens"] == 0 and sd["acceptance_length"] == 1.0
        assert "Draft acceptance rate:" in format_report(result["metrics"])
