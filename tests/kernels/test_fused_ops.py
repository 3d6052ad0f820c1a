"""The fused element-wise C++ kernels (csrc/fused_ops.cpp) against the torch ops they replace,
and the model run with them against the model run without the C++ kernels."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (2, 1, 16)])
@pytest.mark.parametrize("rows", [1, 7, 70])
def test_rope_and_cache_matches_rope_then_index_copy(kernels, dtype, heads, kv_heads, dim, rows):
    torch.manual_seed(rows + heads)
    rope = RotaryEmbedding(dim, 512, 10000.0, None, dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.randint(0, 512, (rows,))
    slots = torch.randperm(200)[:rows]
    k_cache = torch.full((200, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full((200, kv_heads, dim), float("nan"), dtype=dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_rot = rope(positions, q.view(rows, heads, dim), k.view(rows, kv_heads, dim))
    ref_k.index_copy_(0, slots, k_rot)
    ref_v.index_copy_(0, slots, v.reshape(rows, kv_heads, dim))

    q_out = kernels.rope_and_cache(qkv, positions, rope.cos, rope.sin, k_cache, v_cache, slots, heads, kv_heads)
    tol = 0 if dtype == torch.bfloat16 else 1e-5  # bf16: the same roundings as the torch ops
    torch.testing.assert_close(q_out, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache, ref_k, atol=tol, rtol=tol, equal_nan=True)  # other slots untouched
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)


def test_rope_and_cache_refuses_bad_shapes(kernels):
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32)
    cache = torch.zeros(8, 1, 16)
    with pytest.raises(RuntimeError, match="qkv must be"):
        kernels.rope_and_cache(
            torch.zeros(2, 16 * 5),
            torch.zeros(2, dtype=torch.long),
            rope.cos,
            rope.sin,
            cache,
            cache.clone(),
            torch.zeros(2, dtype=torch.long),
            2,
            1,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 33])
def test_fused_add_rms_norm_matches_add_then_norm(kernels, dtype, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.bind_kernels(kernels)
    norm.weight.data = torch.rand(576).to(dtype) + 0.5
    x, residual = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    want_residual = x + residual
    want = norm(want_residual)
    got, got_residual = norm(x.clone(), residual.clone())
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got, want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    # The torch fallback (no kernels) returns the same pair.
    ref, ref_residual = RMSNorm.forward(norm, x.clone().t().contiguous().t(), residual.clone().t().contiguous().t())
    assert torch.equal(ref_residual, want_residual)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_model_with_fused_kernels_matches_without(tiny_llama_dir, monkeypatch, dtype):
    """Greedy tokens and logprobs of prompts and chunked decode: fused kernels on vs off."""
    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Hello"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    kw = dict(
        dtype=dtype,
        kv_cache_memory=0.02,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
    )
    with_kernels = LLM(tiny_llama_dir, **kw).generate(prompts, params)
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "1")
    without = LLM(tiny_llama_dir, **kw).generate(prompts, params)
    for a, b in zip(with_kernels, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        assert max(abs(x - y) for x, y in zip(la, lb)) < (
            0.1 if dtype == "bfloat16" else 1e-3
        )  # bf16: a few roundings apart after 12 steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 40), (64, 100)])
def test_silu_and_mul_matches_torch(kernels, dtype, rows, inter):
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter) * 4).to(dtype)  # wide range: both sigmoid branches, saturation
    gate, up = gate_up.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = kernels.silu_and_mul(gate_up)
    if dtype == torch.bfloat16:  # at most one bf16 step apart (exp's last bits may round differently)
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 37), (33, 1000)])
def test_argmax_rows_matches_torch_max(kernels, rows, vocab):
    """Greedy sampling's argmax: torch's first-max tie rule, tails shorter than a vector, rows
    whose logits are all equal or -inf but one (a grammar mask)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, vocab)
    x[0, vocab // 2] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first one wins
    if rows > 1:
        x[1] = 3.0
        x[-1] = float("-inf")
        x[-1, vocab - 1] = 0.0
    assert torch.equal(kernels.argmax_rows(x), x.max(dim=-1).indices)
