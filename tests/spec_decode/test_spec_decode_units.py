"""Speculative decoding building blocks: config parsing, n-gram and suffix proposers, and exact
verification (rejection sampling), each against a brute-force reference or the exact distribution."""

from __future__ import annotations

import random
import time
from array import array

import numpy as np
import pytest
import torch

from tokenmill.spec_decode import NgramProposer, SpeculativeConfig, SuffixProposer, TokenBuffer, rejection_sample
from tokenmill.spec_decode.suffix import _GlobalTree

# ---------------------------------------------------------------- config


def test_config_defaults_and_aliases():
    c = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_json(
        {"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    )
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 5)
    assert SpeculativeConfig.from_json({"model": "ngram", "num_speculative_tokens": 3}).method == "ngram"
    c = SpeculativeConfig.from_json(
        {"model": "/m/draft", "num_speculative_tokens": 3, "dtype": "bfloat16", "quantization": "int8"}
    )
    assert (c.method, c.model, c.dtype, c.quantization) == ("draft_model", "/m/draft", "bfloat16", "int8")
    c = SpeculativeConfig.from_json({"method": "suffix"})
    assert c.num_speculative_tokens == 24 and c.suffix_decoding_max_cached_requests == 10000
    assert c.suffix_decoding_max_spec_factor == 1.0 and c.suffix_decoding_min_token_prob == 0.1
    c = SpeculativeConfig.from_json(
        {
            "method": "suffix",
            "num_speculative_tokens": 5,
            "suffix_decoding_max_tree_depth": 16,
            "suffix_decoding_min_token_prob": 0,
        }
    )
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth) == (5, 16)
    assert isinstance(c.suffix_decoding_min_token_prob, float)


@pytest.mark.parametrize(
    "spec, msg",
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "promt_lookup_max": 3}', "unknown key"),
        ('{"method": "eagle", "num_speculative_tokens": 4}', "unknown method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "must be >= 1"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"num_speculative_tokens": 2}', 'give "method"'),
        ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be an integer"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "must be an integer"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "in [0, 1]"),
        ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', ">= 1"),
        ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', ">= 0"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "/m/x"}', "takes no draft model"),
        ('{"method": "suffix", "prompt_lookup_max": 2}', "apply to method 'ngram' only"),
        ('{"model": "/m/x", "num_speculative_tokens": 2, "quantization": "fp8"}', "unknown quantization"),
        ('{"model": "/m/x", "num_speculative_tokens": 2, "dtype": "int3"}', "unknown dtype"),
        ('{"method": "ngram", ', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_config_errors(spec, msg):
    with pytest.raises(ValueError, match=msg.replace("[", "\\[").replace("]", "\\]")):
        SpeculativeConfig.from_json(spec)


# ---------------------------------------------------------------- n-gram


def _ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """vLLM's rule by brute force: longest n, then the earliest occurrence ending before the last token."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = tokens[L - n :]
        for j in range(L - n):
            if tokens[j : j + n] == tail:
                return tokens[j + n : j + n + k]
    return []


def test_ngram_matches_and_rules():
    assert NgramProposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # vLLM's docstring example
    ctx = [3, 50, 51, 1, 2, 3, 60, 61, 9, 2, 3, 70, 1, 2, 3]
    assert NgramProposer(3, 1, 3).propose(ctx) == [60, 61, 9]  # the 3-gram wins over shorter ones
    assert NgramProposer(3, 1, 2).propose(ctx) == [60, 61, 9]  # "2 3": earliest occurrence at 4
    assert NgramProposer(3, 1, 1).propose(ctx) == [50, 51, 1]  # "3": earliest at 0
    assert NgramProposer(2, 1, 3).propose(ctx) == [60, 61]  # k cap
    assert NgramProposer(5, 1, 3).propose(ctx, k=1) == [60]  # per-call k
    assert NgramProposer(3, 1, 3).propose([1, 1, 1, 1, 1]) == [1, 1]  # overlapping; only what follows
    assert NgramProposer(3, 1, 3).propose([5, 6, 7, 8]) == []  # no match
    assert NgramProposer(3, 2, 3).propose([5, 6, 7, 5, 8, 7]) == []  # only a 1-gram recurs: below min_n
    assert NgramProposer(3, 1, 3).propose([5]) == [] and NgramProposer(3, 1, 3).propose([]) == []
    assert NgramProposer(3, 1, 3).propose(np.array(ctx, dtype=np.int64)) == [60, 61, 9]


def test_ngram_against_reference():
    rng = random.Random(0)
    for _ in range(400):
        L, V = rng.randint(1, 60), rng.randint(2, 5)
        toks = [rng.randrange(V) for _ in range(L)]
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 6), rng.randint(1, 6)
        assert NgramProposer(k, min_n, max_n).propose(toks) == _ngram_reference(toks, k, min_n, max_n), toks


def test_ngram_fast_on_long_context():
    rng = np.random.default_rng(0)
    buf = TokenBuffer(rng.integers(0, 49152, 8192))
    prop = NgramProposer(4, 2, 5)
    t = time.perf_counter()
    for _ in range(200):
        prop.propose(buf.view())
    assert (time.perf_counter() - t) / 200 < 2e-3  # measured ~20 us; O(L * n) Python would be ~10 ms


def test_token_buffer():
    b = TokenBuffer([1, 2])
    for i in range(100):
        b.extend([i, i + 1])
    b.truncate(50)
    assert len(b) == 50 and b.view().tolist() == ([1, 2] + [x for i in range(100) for x in (i, i + 1)])[:50]


# ---------------------------------------------------------------- suffix


def _suffix_reference(
    ctx: list[int], cached: list[list[int]], k: int, D: int, factor: float, min_prob: float
) -> list[int]:
    """The algorithm by brute force over the texts: every match length, every source, best score."""
    best = (0.0, 0, 0, [])
    for src, texts in ((0, cached), (1, [ctx])):
        for m in range(1, min(D - 1, len(ctx)) + 1):
            tail = ctx[len(ctx) - m :]
            occ = [
                (t, e + 1)
                for t in texts
                for e in range(m - 1, len(t))
                if t[e - m + 1 : e + 1] == tail and (t is not ctx or e < len(ctx) - 1)
            ]
            cap = min(k, int(factor * m), D - m)
            draft, prob, score = [], 1.0, 0.0
            while occ and len(draft) < cap:
                occ = [(t, p) for t, p in occ if p < len(t)]
                if not occ:
                    break
                freq: dict[int, int] = {}
                for t, p in occ:
                    freq[t[p]] = freq.get(t[p], 0) + 1
                tok, cnt = max(freq.items(), key=lambda kv: (kv[1], -kv[0]))
                if prob * (cnt / len(occ)) < min_prob:
                    break
                prob *= cnt / len(occ)
                draft.append(tok)
                score += prob
                occ = [(t, p + 1) for t, p in occ if t[p] == tok]
            if draft and (score, m, src) > best[:3]:
                best = (score, m, src, draft)
    return best[3]


def test_suffix_own_context_and_global_cache():
    s = SuffixProposer(k=4, max_tree_depth=8)
    s.start_request("a", [10, 11, 12, 13, 14, 99, 10, 11])
    assert s.propose("a") == [12, 13]  # match "10 11": draft capped by spec factor 1.0 * 2
    s.add_tokens("a", [12])
    assert s.propose("a") == [13, 14, 99]
    s.add_tokens("a", [13, 14, 20, 21, 22, 23])
    s.finish_request("a")  # its output 12 13 14 20 21 22 23 joins the global tree
    assert s.num_cached_requests == 1
    s.start_request("b", [7, 7, 20, 21])
    d = s.speculate("b")
    assert (d.token_ids, d.source, d.match_len) == ([22, 23], "global", 2)
    s.finish_request("b", cache=False)  # an abort caches nothing
    assert s.num_cached_requests == 1
    assert s.propose("c", [1, 2, 3]) == []  # unknown id: starts with the given context
    assert s.propose("d", [30, 31, 32, 33], num_prompt_tokens=2) == []
    s.finish_request("d")  # its output 32 33 is cached
    assert s.propose("e", [5, 32]) == [33]
    assert s.num_cached_requests == 2


def test_suffix_probability_threshold_and_factor():
    # "5" is followed by 1, 1, 2, 3 (1: probability 1/2), and "5 1" by 6 or 7 (each 1/2).
    ctx = [5, 1, 6, 5, 1, 7, 5, 2, 8, 5, 3, 9, 5]
    s = SuffixProposer(k=4, max_tree_depth=8, min_token_prob=0.2, max_spec_factor=2.0)
    s.start_request("r", ctx)
    d = s.speculate("r")
    # Match "5" (length 1, so 2 tokens at factor 2): 1 (1/2), then 6 (the tie's smaller id, 1/2 * 1/2).
    assert d.token_ids == [1, 6] and d.score == pytest.approx(0.5 + 0.25) and d.match_len == 1
    s.min_token_prob = 0.3  # the second token's estimated probability 0.25 falls below it
    assert s.propose("r") == [1]
    s.min_token_prob = 0.6
    assert s.propose("r") == []
    s.min_token_prob, s.max_spec_factor = 0.2, 1.0  # a 1-token match allows 1 token
    assert s.propose("r") == [1]
    s.max_spec_factor = 2.0
    assert s.propose("r", k=1) == [1]


def test_suffix_eviction_bound_restores_tree():
    s = SuffixProposer(k=3, max_tree_depth=6, max_cached_requests=2, insert_budget=None)
    outs = [[1, 2, 3, 4, 1, 2, 5], [7, 8, 9, 7, 8], [1, 2, 9, 9, 1, 2, 9]]
    for i, out in enumerate(outs):
        s.start_request(str(i), [0])
        s.add_tokens(str(i), out)
        s.finish_request(str(i))
    assert s.num_cached_requests == 2
    fresh = _GlobalTree(6)
    for out in outs[1:]:
        fresh.add(array("i", out))
    assert _dump(s._global.root, 6) == _dump(fresh.root, 6)  # removal leaves what never having it leaves
    s2 = SuffixProposer(k=3, max_tree_depth=6, max_cached_requests=1, insert_budget=None)
    for i, out in enumerate(outs):
        s2.start_request(str(i), [0])
        s2.add_tokens(str(i), out)
        s2.finish_request(str(i))
    s2._global.remove(s2._cached.popleft().seq)
    assert s2._global.root.children == {} and s2._global.root.total == 0  # nothing leaks


def test_suffix_amortised_insertion_converges():
    outs = [[1, 2, 3, 4, 1, 2, 5] * 3, [7, 8, 9, 7, 8] * 4, [1, 2, 9, 9, 1, 2, 9] * 2]
    eager = SuffixProposer(k=3, max_tree_depth=6, max_cached_requests=2, insert_budget=None)
    lazy = SuffixProposer(k=3, max_tree_depth=6, max_cached_requests=2, insert_budget=4)
    for i, out in enumerate(outs):
        for s in (eager, lazy):
            s.start_request(str(i), [0])
            s.add_tokens(str(i), out)
            s.finish_request(str(i))
        lazy.propose("x", [1, 2])  # 4 suffixes per call: output 0 is evicted while half inserted
    assert _dump(lazy._global.root, 6) != _dump(eager._global.root, 6)
    for _ in range(20):
        lazy.propose("x", [1, 2])
    assert not lazy._pending and _dump(lazy._global.root, 6) == _dump(eager._global.root, 6)
    assert lazy.propose("y", [5, 7, 8]) == eager.propose("y", [5, 7, 8]) == [9, 7]  # match "7 8": 2 tokens
    lazy.insert_budget = 0  # inserted only by flush()
    lazy.start_request("z", [0])
    lazy.add_tokens("z", [4, 4, 4])
    lazy.finish_request("z")
    lazy.propose("y")
    assert len(lazy._pending) == 1
    lazy.flush()
    assert not lazy._pending


def _dump(root, depth: int) -> dict:
    """Canonical content of a trie: path -> count, lone chains expanded (to the depth limit)."""
    out = {}

    def walk(n, path):
        out[path] = n.count
        if n.seq is not None:
            for j in range(n.pos, min(len(n.seq), n.pos + depth - len(path))):
                path = path + (n.seq[j],)
                out[path] = 1
            return
        for t, c in (n.children or {}).items():
            walk(c, path + (t,))

    walk(root, ())
    return out


def test_suffix_against_reference_incremental_equals_rebuild():
    rng = random.Random(1)
    for case in range(150):
        D, k = rng.randint(2, 7), rng.randint(1, 5)
        factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3, 0.6])
        cap_req = rng.randint(0, 3)
        inc = SuffixProposer(k, D, cap_req, factor, min_prob, insert_budget=None)
        cached: list[list[int]] = []
        for r in range(4):
            V = rng.randint(2, 4)
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
            ctx = list(prompt)
            inc.start_request(f"r{r}", prompt)
            for _step in range(rng.randint(1, 15)):
                want = _suffix_reference(ctx, cached, k, D, factor, min_prob)
                assert inc.propose(f"r{r}") == want, (case, ctx, cached)
                rebuilt = SuffixProposer(k, D, cap_req, factor, min_prob, insert_budget=None)
                rebuilt._global, rebuilt._cached = inc._global, inc._cached
                assert rebuilt.propose("x", ctx) == want
                new = [rng.randrange(V) for _ in range(rng.randint(1, 3))]
                inc.add_tokens(f"r{r}", new)
                ctx += new
            inc.finish_request(f"r{r}")
            if cap_req:
                cached = (cached + [ctx[len(prompt) :]])[-cap_req:]


def test_suffix_cost_2k_context():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 500, 2048).tolist()
    s = SuffixProposer(k=4)
    for r in range(20):  # a warm global cache: 20 earlier outputs of 512 tokens
        s.start_request(f"old{r}", [0])
        s.add_tokens(f"old{r}", rng.integers(0, 500, 512).tolist())
        s.finish_request(f"old{r}")
    s.start_request("r", text)
    t = time.perf_counter()
    for i in range(100):
        s.propose("r")
        s.add_tokens("r", [int(text[i])])
    assert (time.perf_counter() - t) / 100 < 5e-3  # measured well under 1 ms


# ---------------------------------------------------------------- rejection sampling


def test_greedy_exact():
    V = 7
    torch.manual_seed(0)
    drafts = [[3, 1, 4], [], [2, 2], [5]]
    n_rows = sum(len(d) + 1 for d in drafts)
    argmax = torch.tensor(
        [
            3,
            1,
            6,
            0,  # accepts 3, 1, rejects 4 -> 6
            4,  # no drafts -> 4
            2,
            2,
            5,  # accepts both -> bonus 5
            1,
            9 % V,
        ]
    )  # rejects 5 -> 1
    out = rejection_sample(drafts, torch.rand(n_rows, V), argmax, [True] * 4)
    assert out.token_ids == [[3, 1, 6], [4], [2, 2, 5], [1]]
    assert out.num_accepted == [2, 0, 2, 0]
    assert out.accepted_per_position([3, 0, 2, 1]) == [(3, 2), (2, 2), (1, 0)]
    out2 = rejection_sample(drafts, None, argmax, [True] * 4)  # probabilities not needed
    assert out2.token_ids == out.token_ids


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF5_999 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _draw(p_rows: torch.Tensor, drafts: list[int], n: int, seed: int, method: str):
    """n requests with the same rows (k = len(drafts)) in one call."""
    g = torch.Generator().manual_seed(seed)
    return rejection_sample([drafts] * n, p_rows.repeat(n, 1), None, [False] * n, generator=g, sample_method=method)


P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
P1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
P2 = torch.tensor([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])


@pytest.mark.parametrize("method", ["exponential", "inverse_cdf"])
def test_rejection_one_hot_drafts_exact_distribution(method):
    n = 20000
    out = _draw(torch.stack([P0, P1, P2]), [1, 0], n, seed=1, method=method)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert _chi2(torch.bincount(first, minlength=6).float(), P0) < CHI2_DF5_999
    # Given the first draft accepted, the second emitted token follows row 1 (the context + draft 1).
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == 1])
    assert _chi2(torch.bincount(second, minlength=6).float(), P1) < CHI2_DF5_999
    acc = torch.tensor(out.num_accepted)
    # P(accept draft 1) = p0(1) = 0.3; P(both) = 0.3 * p1(0) = 0.12 (binomial sd ~ 0.003)
    assert abs(float((acc >= 1).float().mean()) - 0.30) < 0.015
    assert abs(float((acc >= 2).float().mean()) - 0.12) < 0.012
    assert all(len(t) == a + 1 for t, a in zip(out.token_ids, out.num_accepted, strict=True))


@pytest.mark.parametrize("method", ["exponential", "inverse_cdf"])
def test_rejection_draft_model_exact_distribution(method):
    n = 20000
    q = torch.tensor([0.30, 0.05, 0.40, 0.05, 0.10, 0.10])
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()  # x ~ q
    tp = torch.stack([P0, P1]).repeat(n, 1)
    out = rejection_sample(
        [[x] for x in drafts],
        tp,
        None,
        [False] * n,
        q.repeat(n, 1),
        generator=torch.Generator().manual_seed(2),
        sample_method=method,
    )
    first = torch.tensor([t[0] for t in out.token_ids])
    assert _chi2(torch.bincount(first, minlength=6).float(), P0) < CHI2_DF5_999
    rate = sum(out.num_accepted) / n  # acceptance = sum(min(p, q)) = 0.45
    assert abs(rate - float(torch.minimum(P0, q).sum())) < 0.02
    # Guard against a test that cannot fail: drawing the first token from q instead is rejected.
    assert _chi2(torch.bincount(torch.tensor(drafts), minlength=6).float(), P0) > CHI2_DF5_999


def test_rejection_unnormalised_rows():
    """Rows as the Sampler leaves them after min-p (masked, not renormalised) still give p exactly."""
    n = 20000
    scale = torch.tensor([[0.37], [0.81]])
    q = torch.tensor([0.30, 0.05, 0.40, 0.05, 0.10, 0.10])
    drafts = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(5)).tolist()
    for dp in (None, (q * 0.5).repeat(n, 1)):
        out = rejection_sample(
            [[x] for x in drafts],
            (torch.stack([P0, P1]) * scale).repeat(n, 1),
            None,
            [False] * n,
            dp,
            generator=torch.Generator().manual_seed(3),
        )
        first = torch.tensor([t[0] for t in out.token_ids])
        assert _chi2(torch.bincount(first, minlength=6).float(), P0) < CHI2_DF5_999
        want = float(torch.minimum(P0, q).sum()) if dp is not None else float((P0 * q).sum())  # P(accept)
        assert abs(sum(out.num_accepted) / n - want) < 0.02


def test_rejection_empty_and_no_drafts():
    assert rejection_sample([], torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), []).token_ids == []
    p = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    out = rejection_sample([[], []], p, torch.tensor([2, 1]), [False, True], sample_method="inverse_cdf")
    assert out.token_ids == [[2], [1]] and out.num_accepted == [0, 0]


def test_rejection_seeded_batch_invariant_and_matches_sampler(monkeypatch):
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    from tokenmill.sample.sampler import Sampler, SamplingBatch
    from tokenmill.spec_decode import target_distributions

    V = 50
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch(
        temperature=torch.tensor([0.7, 0.0, 1.3, 1.0]),
        all_greedy=False,
        top_k=torch.tensor([V, V, 10, V]),
        top_p=torch.tensor([0.9, 1.0, 1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]),
        generators=[torch.Generator().manual_seed(s) for s in (11, 12, 13, 14)],
        repetition_penalty=None,
        presence_penalty=None,
        frequency_penalty=None,
        output_counts=None,
        seen_mask=None,
        banned=None,
        banned_rows=[],
        num_logprobs=[None] * 4,
        logit_bias=None,
        watermark_rows=[],
        watermark_prev=[],
    )
    want = Sampler()(logits, batch).token_ids
    probs, argmax = target_distributions(Sampler(), logits, batch)
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13, 14)]
    out = rejection_sample(
        [[]] * 4, probs, argmax, [False, True, False, False], generators=gens, sample_method="inverse_cdf"
    )
    assert [t[0] for t in out.token_ids] == want  # no drafts: exactly the Sampler's token
    # A seeded request gives the same tokens alone and in a batch with others.
    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(3)), -1)
    alone = rejection_sample([[4, 7]], p, None, [False], generators=[torch.Generator().manual_seed(9)])
    other = torch.softmax(torch.randn(2, V), -1)
    mixed = rejection_sample(
        [[1], [4, 7]], torch.cat([other, p]), None, [False, False], generators=[None, torch.Generator().manual_seed(9)]
    )
    assert mixed.token_ids[1] == alone.token_ids[0]
    for method in ("exponential", "inverse_cdf"):  # also with seeded and unseeded rows mixed
        runs = [
            rejection_sample(
                [[4, 7], [1]],
                torch.cat([p, other]),
                None,
                [False, False],
                generators=[torch.Generator().manual_seed(9), None],
                sample_method=method,
            )
            for _ in range(2)
        ]
        assert runs[0].token_ids[0] == runs[1].token_ids[0]


def test_inverse_cdf_edges():
    from tokenmill.sample.sampler import inverse_cdf

    dist = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    u = torch.tensor([[0.0], [0.999999999]], dtype=torch.float64)
    assert inverse_cdf(dist, u).tolist() == [1, 2]  # zero-mass tokens never drawn, at either end
    assert inverse_cdf(dist, torch.tensor([[0.5], [1.0]], dtype=torch.float64)).tolist() == [3, 2]
    # Across blocks (V = 700: two full blocks of 256 and a padded one): each u lands on the token
    # whose cumulative interval holds it, as a plain float64 cumsum says.
    g = torch.Generator().manual_seed(0)
    big = torch.rand(64, 700, generator=g) * (torch.rand(64, 700, generator=g) < 0.1)
    big[:, 699] = 0.0
    big[0, :257] = 0.0  # a first block without mass, with u = 0: the draw must skip it
    u = torch.rand(64, 1, dtype=torch.float64, generator=g)
    u[0, 0], u[1, 0] = 0.0, 1.0 - 2**-53
    cdf = big.double().cumsum(dim=1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=698)
    got = inverse_cdf(big, u)
    assert (big[torch.arange(64), got] > 0).all()
    assert (got != want).sum() <= 1  # float32 block sums may move a draw at a rounding edge, no more


def test_rejection_mixed_greedy_and_errors():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    argmax = torch.tensor([0, 0, 0, 1, 2])
    out = rejection_sample([[1, 2], [1]], p, argmax, [False, True])
    assert out.token_ids == [[1, 2, 0], [1, 2]]  # p = 1 drafts always accepted; greedy uses argmax
    with pytest.raises(ValueError, match="rows"):
        rejection_sample([[1, 2]], p, None, [False])
    with pytest.raises(ValueError, match="target_argmax is required"):
        rejection_sample([[1]], p[:2], None, [True])
    with pytest.raises(ValueError, match="target_probs is required"):
        rejection_sample([[1]], None, argmax[:2], [False])


def test_drafter_rations_drafts_by_expected_gain_and_step_cost():
    """A lone request with good acceptance drafts deeply; at 8 decoding requests only the likeliest
    draft (and less); at 32 none; a request whose drafts fail is probed only in small steps."""
    from tokenmill.request import Request, RequestStatus
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.spec_decode.drafter import Drafter, _Track

    class Fixed:
        def propose(self, req, k):
            return [7] * k

        def add_tokens(self, req, tokens):
            pass

        def finish(self, req):
            pass

    def decoding(i: int) -> Request:
        r = Request(str(i), [1, 2, 3], SamplingParams(max_tokens=100))
        r.status = RequestStatus.RUNNING
        r.append_output_token(5)
        r.num_computed_tokens = r.num_tokens - 1
        return r

    def drafted(n: int, rates: list[float], idle: int = 0) -> list[int]:
        d = Drafter(SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 8}), Fixed(), 4096)
        reqs = [decoding(i) for i in range(n)]
        for r, a in zip(reqs, rates):
            d._tracks[r.request_id] = _Track(accepted=a, trials=1.0, idle_steps=idle)
        d.propose(reqs)
        return [len(r.spec_token_ids) for r in reqs]

    assert drafted(1, [0.9]) == [7]  # 0.9**8 = 0.43 < what the 9th row costs (~0.54)
    assert drafted(1, [0.6]) == [2]  # 0.6**3 = 0.22 < 0.3
    assert drafted(1, [0.2]) == [0]
    assert drafted(1, [0.2], idle=7) == [1]  # the probe
    eight = drafted(8, [0.95] + [0.6] * 7)
    assert eight[0] >= 1 and sum(eight[1:]) == 0
    assert sum(drafted(8, [0.2] * 8, idle=7)) == 0  # no probes once rows cost compute
    assert sum(drafted(24, [0.8] * 24)) == 0  # needs a >~ 0.88 there
    assert sum(drafted(32, [0.99] * 32)) == 0
