"""The mixture-of-experts kernel (csrc/moe.cpp) against torch: random shapes, ragged expert
loads, experts with no rows, float32 and bf16, and a row's result independent of its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.layers.moe import experts_dense, experts_reference, route


def torch_experts(x, w13, w2, ids, weights):
    """Straight from the definition, one token at a time, float64."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def make(T, E, k, H, I, dtype, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens on expert 0, some experts never chosen
        logits[:, 0] += 4
        logits[:, E // 2 :] -= 20
    weights, ids = route(logits, k, renormalize=True)
    return x, w13, w2, ids, weights


SHAPES = [  # T, E, k, H, I: vector tails (H, I not multiples of 8 / 16), single tokens, many rows per expert
    (1, 4, 2, 64, 32),
    (7, 4, 2, 64, 48),
    (33, 8, 2, 72, 40),
    (5, 3, 1, 20, 12),
    (64, 8, 3, 128, 96),
    (200, 6, 2, 48, 24),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_dense_experts_match_the_definition(shape):
    """The graph-capturable path (every expert over every row, CUDA graphs' decode steps) picks
    each row's top-k right: against the float64 definition, on the CPU."""
    T, E, k, H, I = shape
    x, w13, w2, ids, weights = make(T, E, k, H, I, torch.float32, seed=7, skew=True)
    torch.testing.assert_close(
        experts_dense(x, w13, w2, ids, weights).double(), torch_experts(x, w13, w2, ids, weights), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("skew", [False, True])
def test_float32_matches_torch(kernels, shape, skew):
    x, w13, w2, ids, weights = make(*shape, torch.float32, seed=sum(shape), skew=skew)
    got = kernels.moe_experts(x, w13, w2, ids, weights)
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = torch_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts_reference(x, w13, w2, ids, weights).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_matches_torch(kernels, shape):
    x, w13, w2, ids, weights = make(*shape, torch.bfloat16, seed=sum(shape), skew=True)
    got = kernels.moe_experts(x, w13, w2, ids, weights)
    assert got.dtype == torch.bfloat16
    ref = experts_reference(x, w13, w2, ids, weights)  # torch's bf16 ops, rounded where the kernel rounds
    exact = torch_experts(x, w13, w2, ids, weights)
    # Within a few bf16 ulps of torch's bf16 ops, and as close to the float64 truth as they are.
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert (got.double() - exact).abs().max() <= 1.5 * (ref.double() - exact).abs().max() + 1e-2


def test_experts_without_rows_and_empty_batch(kernels):
    x, w13, w2, ids, weights = make(6, 8, 2, 32, 16, torch.float32, seed=1)
    ids = torch.tensor([[5, 2]] * 6, dtype=torch.int32)  # 6 of 8 experts idle
    got = kernels.moe_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(got.double(), torch_experts(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    empty = kernels.moe_experts(x[:0], w13, w2, ids[:0], weights[:0])
    assert empty.shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(kernels, dtype):
    """A row's result is the same bits alone, in any batch, and in any position of it."""
    x, w13, w2, ids, weights = make(48, 4, 2, 96, 40, dtype, seed=7)
    full = kernels.moe_experts(x, w13, w2, ids, weights)
    for t in (0, 13, 47):
        alone = kernels.moe_experts(x[t : t + 1], w13, w2, ids[t : t + 1], weights[t : t + 1])
        assert torch.equal(alone, full[t : t + 1])
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernels.moe_experts(x[perm], w13, w2, ids[perm], weights[perm]), full[perm])
    with_more = torch.cat([x, x.flip(0)])
    more = kernels.moe_experts(with_more, w13, w2, torch.cat([ids, ids.flip(0)]), torch.cat([weights, weights.flip(0)]))
    assert torch.equal(more[:48], full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_alone_or_in_a_full_expert(kernels, dtype):
    """Every row routed to the same two experts, in batches whose sizes leave every register tile
    shape (1-4 rows, column tails: H and I not multiples of 24) in use: each row's result is the
    same bits as that row alone."""
    x, w13, w2, _, weights = make(31, 4, 2, 88, 56, dtype, seed=11)
    ids = torch.tensor([[2, 0]] * 31, dtype=torch.int32)
    alone = torch.cat([kernels.moe_experts(x[t : t + 1], w13, w2, ids[:1], weights[t : t + 1]) for t in range(31)])
    for n in (2, 3, 5, 6, 7, 13, 31):
        assert torch.equal(kernels.moe_experts(x[:n], w13, w2, ids[:n], weights[:n]), alone[:n]), n


def test_thread_count_does_not_change_results(kernels):
    x, w13, w2, ids, weights = make(40, 8, 2, 256, 128, torch.bfloat16, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.moe_experts(x, w13, w2, ids, weights)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, kernels.moe_experts(x, w13, w2, ids, weights))


def test_bad_input_is_refused(kernels):
    x, w13, w2, ids, weights = make(4, 4, 2, 32, 16, torch.float32, seed=2)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.moe_experts(x, w13, w2, ids + 3, weights)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.moe_experts(x, w13.bfloat16(), w2, ids, weights)
    with pytest.raises(RuntimeError, match="int32"):
        kernels.moe_experts(x, w13, w2, ids.long(), weights)
