"""--kv-cache-dtype int8: quantization, the kernel on an int8 cache, memory, and quality."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, reference_paged_decode

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.attention import quantize_int8

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_quantize_round_trip_and_input_untouched():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    before = x.clone()
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (50, 3) and scale.dtype == torch.float32
    assert torch.equal(x, before)
    err = (q.float() * scale.unsqueeze(-1) - x).abs()
    assert (err <= scale.unsqueeze(-1) * 0.5 + 1e-6).all()  # at most half a step per element
    assert q.abs().amax(-1).eq(127).all()  # the absmax maps to the full range


def test_kernel_reads_int8_cache(tiny_llama_llm):
    kernels = tiny_llama_llm.engine.core.runner.attn.kernels
    if kernels is None:
        pytest.skip("C++ kernels unavailable on this machine")
    torch.manual_seed(0)
    bs, H, Hkv, D, B = 16, 8, 2, 64, 5
    kq, ks = quantize_int8(torch.randn(40 * bs, Hkv, D))
    vq, vs = quantize_int8(torch.randn(40 * bs, Hkv, D))
    lens = torch.tensor([1, 17, 33, 64, 5])
    tables = torch.randperm(39)[: B * 4].view(B, 4) + 1
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(B, H, D, dtype=dtype)
        out = kernels.paged_decode(q, kq, vq, tables, lens, bs, D**-0.5, ks, vs)
        ref = reference_paged_decode(q, kq.float() * ks.unsqueeze(-1), vq.float() * vs.unsqueeze(-1), tables, lens, bs)
        for b in range(B):
            assert (out[b].float() - ref[b]).abs().max() < tol


def test_int8_cache_memory_and_kernel_vs_torch_path(tiny_llama_dir, monkeypatch):
    full = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01)
    int8 = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01, kv_cache_dtype="int8")
    cfg = int8.engine.config.model
    assert cfg.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert int8.engine.core.runner.kv_cache.dtype == torch.int8
    # head_dim 16: 20 bytes per head instead of 32 in bf16.
    assert int8.engine.core.kv.num_usable_blocks >= 1.55 * full.engine.core.kv.num_usable_blocks
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    torch_path = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01, kv_cache_dtype="int8")
    assert torch_path.engine.core.runner.attn.kernels is None
    monkeypatch.delenv("TOKENMILL_NO_CPP_KERNELS")
    kernel_path = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    a = torch_path.generate(PROMPTS, params)
    b = kernel_path.generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lp = [abs(next(iter(p.values())).logprob - next(iter(q.values())).logprob)
              for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs)]
        assert max(lp) < 1e-3
    for llm in (torch_path, kernel_path):
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_usable_blocks


def test_int8_cache_with_prefix_caching_and_chunking(tiny_llama_dir):
    kw = dict(dtype="float32", kv_cache_memory=0.01, kv_cache_dtype="int8", max_num_batched_tokens=8)
    on = LLM(tiny_llama_dir, **kw)
    off = LLM(tiny_llama_dir, enable_prefix_caching=False, **kw)
    prompts = [PROMPTS[5] + f" {i}" for i in range(4)]
    for _ in range(2):
        a = on.generate(prompts, GREEDY)
        b = off.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert on.engine.core.kv.stats.hits > 0


def test_int8_cache_quality_on_smollm2(smollm2_dir, smollm2_llm):
    """Against the float32 cache: the same greedy start, and close logprobs where the context is shared."""
    int8 = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.25, kv_cache_dtype="int8")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    ref = smollm2_llm.generate(PROMPTS, params)
    got = int8.generate(PROMPTS, params)
    diffs, same_start = [], 0
    for r, g in zip(ref, got):
        rt, gt = r.outputs[0].token_ids, g.outputs[0].token_ids
        same_start += rt[:4] == gt[:4]
        for i in range(len(rt)):
            if rt[i] != gt[i]:
                break
            diffs.append(abs(next(iter(r.outputs[0].logprobs[i].values())).logprob
                             - next(iter(g.outputs[0].logprobs[i].values())).logprob))
    assert same_start >= len(PROMPTS) - 1
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5


def test_unknown_kv_cache_dtype_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype.*auto, int8"):
        LLM(tiny_llama_dir, kv_cache_dtype="int4")
