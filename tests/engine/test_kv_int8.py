"""--kv-cache-dtype int8 / fp8 (float8 e4m3): quantization, the cache-write and attention kernels
on a quantized cache, memory, and quality."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, reference_paged_decode

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.attention import quantize_kv
from tokenmill.model.layers.bind import bind_kernels, kernels_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
kv_dtypes = pytest.mark.parametrize("kv", list(KV_DTYPES))


@kv_dtypes
def test_quantize_round_trip_and_input_untouched(kv):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    before = x.clone()
    q, scale = quantize_kv(x, KV_DTYPES[kv])
    assert q.dtype == KV_DTYPES[kv] and scale.shape == (50, 3) and scale.dtype == torch.float32
    assert torch.equal(x, before)
    s = scale.unsqueeze(-1)
    err = (q.float() * s - x).abs()
    if kv == "int8":
        assert (err <= s * 0.5 + 1e-6).all()  # at most half a step per element
        assert q.abs().amax(-1).eq(127).all()  # the absmax maps to the full range
    else:  # 3 mantissa bits: half a step is 2^-4 of the value, 2^-10 (x scale) among subnormals
        assert (err <= torch.maximum(x.abs() / 16, s / 1024) * 1.0001 + 1e-9).all()
        assert q.float().abs().amax(-1).eq(448).all()


def dequantized(xq, scale):
    return xq.float() * scale.unsqueeze(-1)


@kv_dtypes
def test_kernels_read_and_write_quantized_cache(tiny_llama_llm, kv):
    """The cache-write kernel gives quantize_kv's bytes; decode, rows and prefill kernels read the
    cache in place as a dequantized float32 reference (ragged tails, 1 to 4 blocks, GQA)."""
    kernels = tiny_llama_llm.engine.core.runner.attn.kernels
    if kernels is None:
        pytest.skip("C++ kernels unavailable on this machine")
    torch.manual_seed(0)
    dtype = KV_DTYPES[kv]
    bs, H, Hkv, D, B = 16, 8, 2, 64, 5
    slots = 40 * bs
    k, v = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    kq, ks = torch.zeros(slots, Hkv, D, dtype=dtype), torch.zeros(slots, Hkv)
    vq, vs = torch.zeros(slots, Hkv, D, dtype=dtype), torch.zeros(slots, Hkv)
    order = torch.randperm(slots)
    for src, cache, sc in ((k, kq, ks), (v, vq, vs)):
        kernels.write_scaled_cache(src[order].to(torch.bfloat16), cache, sc, order)
        ref_q, ref_s = quantize_kv(src.to(torch.bfloat16), dtype)
        assert torch.equal(cache.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(sc, ref_s)
    kf, vf = dequantized(kq, ks), dequantized(vq, vs)
    lens = torch.tensor([1, 17, 33, 64, 5])
    tables = torch.randperm(39)[: B * 4].view(B, 4) + 1
    for qdt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(B, H, D, dtype=qdt)
        ref = reference_paged_decode(q, kf, vf, tables, lens, bs)
        out = kernels.paged_decode(q, kq, vq, tables, lens, bs, D**-0.5, ks, vs)
        assert (out.float() - ref).abs().max() < tol
        # the rows kernel, one row per sequence (each its decode token)
        rows = kernels.paged_rows(q, kq, vq, tables, lens, torch.arange(B + 1), bs, D**-0.5, ks, vs)
        assert (rows.float() - ref).abs().max() < tol
        # prefill: the last 9 tokens of a 33-token sequence over its cached prefix
        qp = torch.randn(9, H, D, dtype=qdt)
        out = kernels.paged_prefill(qp, kq, vq, tables[2], 24, bs, D**-0.5, ks, vs)
        for i in range(9):
            ref = reference_paged_decode(qp[i : i + 1], kf, vf, tables[2:3], torch.tensor([25 + i]), bs)
            assert (out[i].float() - ref[0]).abs().max() < tol


@kv_dtypes
def test_quantized_cache_memory_and_kernel_vs_torch_path(tiny_llama_dir, monkeypatch, kv):
    full = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01)
    quant = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=0.01, kv_cache_dtype=kv)
    cfg = quant.engine.config.model
    assert cfg.kv_bytes_per_token() == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert quant.engine.core.runner.kv_cache.dtype == KV_DTYPES[kv]
    # head_dim 16: 20 bytes per head instead of 32 in bf16.
    assert quant.engine.core.kv.num_usable_blocks >= 1.55 * full.engine.core.kv.num_usable_blocks
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    torch_path = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01, kv_cache_dtype=kv)
    assert torch_path.engine.core.runner.attn.kernels is None
    monkeypatch.delenv("TOKENMILL_NO_CPP_KERNELS")
    # Only the attention differs between the two: the rest of the torch path's model and its sampler
    # get the kernels the kernel path binds at load (else torch's and the kernels' float32 norms put
    # a different int8 rounding into the cache here and there, which is not what this compares).
    runner = torch_path.engine.core.runner
    bind_kernels(runner.model, "cpu", torch.float32)
    runner.sampler.ops = kernels_for("cpu", torch.float32)
    kernel_path = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.01, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    a = torch_path.generate(PROMPTS, params)
    b = kernel_path.generate(PROMPTS, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lp = [
            abs(next(iter(p.values())).logprob - next(iter(q.values())).logprob)
            for p, q in zip(x.outputs[0].logprobs, y.outputs[0].logprobs)
        ]
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


@kv_dtypes
def test_quantized_cache_quality_on_smollm2(smollm2_dir, smollm2_llm, kv):
    """Against the float32 cache: the same greedy start, and close logprobs where the context is shared."""
    quant = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.25, kv_cache_dtype=kv)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    ref = smollm2_llm.generate(PROMPTS, params)
    got = quant.generate(PROMPTS, params)
    diffs, same_start = [], 0
    for r, g in zip(ref, got):
        rt, gt = r.outputs[0].token_ids, g.outputs[0].token_ids
        same_start += rt[:4] == gt[:4]
        for i in range(len(rt)):
            if rt[i] != gt[i]:
                break
            diffs.append(
                abs(
                    next(iter(r.outputs[0].logprobs[i].values())).logprob
                    - next(iter(g.outputs[0].logprobs[i].values())).logprob
                )
            )
    assert same_start >= len(PROMPTS) - 1
    assert sum(diffs) / len(diffs) < 0.05 and max(diffs) < 0.5


def test_unknown_kv_cache_dtype_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'.*auto, int8, fp8, fp8_e4m3"):
        LLM(tiny_llama_dir, kv_cache_dtype="fp4")
