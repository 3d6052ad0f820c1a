"""bf16 linears on panel-packed weights (csrc/panel_linear.cpp): the kernel against a float
reference, its batch invariance, and which layers keep panels (PackedLinear / pack_linears)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers import linear


@pytest.fixture(scope="module")
def panel_kernels(kernels):
    if kernels is None or not linear._panel_kernel_works():
        pytest.skip("no panel kernel here (needs the C++ kernels with AVX512-BF16 or AVX2 + FMA)")
    return kernels


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.runner.model


@pytest.mark.parametrize("N,K", [(40, 64), (96, 32), (833, 576), (13, 1536), (50, 78), (70, 30)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_a_float_reference(panel_kernels, N, K, bias):
    """Rows past the last full panel are padding (N % 32), any batch of 1-64 rows (register tiles
    of 8 and their tails; AMX tiles of 16 rows and a tile of the rest), K past the last 32 inputs
    (AMX's tail tiles), bias added after rounding as `y + bias` is."""
    torch.manual_seed(N + K)
    w = (torch.randn(N, K) / K**0.5).bfloat16()
    b = torch.randn(N).bfloat16() if bias else None
    panels = panel_kernels.pack_panels(w)
    assert panels.shape == (-(-N // 32), K // 2, 32, 2)
    assert torch.equal(panels.view(-1, K // 2, 32, 2).permute(0, 2, 1, 3).reshape(-1, K)[:N], w)  # a permutation
    for M in (1, 3, 8, 9, 16, 17, 64):
        x = torch.randn(M, K).bfloat16()
        ref = (x.float() @ w.float().T).bfloat16()
        if b is not None:
            ref = ref + b
        out = panel_kernels.panel_linear(x, panels, N, b)
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("K", [576, 78])
def test_each_row_is_independent_of_the_batch(panel_kernels, K):
    """A row's outputs are the same bits whatever rows it is batched with (one accumulator per
    output, summed in input order; on AMX a tile's rows never mix, whether it holds 16 rows or
    fewer): decode results do not depend on the batch size."""
    torch.manual_seed(0)
    w = torch.randn(200, K).bfloat16()
    panels = panel_kernels.pack_panels(w)
    x = torch.randn(64, K).bfloat16()
    whole = panel_kernels.panel_linear(x, panels, 200)
    for M in (1, 5, 8, 13, 16, 17, 33):
        assert torch.equal(panel_kernels.panel_linear(x[:M], panels, 200), whole[:M])
    for a, b in ((7, 8), (3, 20), (40, 64)):
        assert torch.equal(panel_kernels.panel_linear(x[a:b], panels, 200), whole[a:b])
    assert panel_kernels.panel_isa() in ("amx-bf16", "avx512-bf16", "avx2-fma")


def test_bad_shapes_are_refused(panel_kernels):
    panels = panel_kernels.pack_panels(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="panel_linear"):
        panel_kernels.panel_linear(torch.zeros(2, 32, dtype=torch.bfloat16), panels, 40)
    with pytest.raises(RuntimeError, match="panel_linear"):
        panel_kernels.panel_linear(torch.zeros(2, 64, dtype=torch.bfloat16), panels, 65)
    with pytest.raises(RuntimeError, match="bias"):
        panel_kernels.panel_linear(torch.zeros(2, 64, dtype=torch.bfloat16), panels, 40, torch.zeros(3).bfloat16())


def test_batch_invariant_linears_run_panels_at_every_size(panel_kernels, tiny_qwen2_dir):
    """Batch-invariant (the default): every linear keeps only panels (no oneDNN copy), and runs
    them at every batch size, so a row gives the same bits in a prompt step of 65+ rows as alone."""
    llm = LLM(tiny_qwen2_dir, dtype="bfloat16", kv_cache_memory=0.02)
    packed = [m for m in _model(llm).modules() if isinstance(m, linear.PackedLinear)]
    assert packed and all(m.panels is not None and m.packed_weight is None for m in packed)
    head = _model(llm).lm_head
    x = torch.randn(3 * linear.SMALL_BATCH + 5, head.in_features).bfloat16()
    whole = head(x)
    assert torch.equal(whole, panel_kernels.panel_linear(x, head.panels, head.out_features))
    for a, b in ((0, 1), (7, 8), (60, 130)):
        assert torch.equal(head(x[a:b]), whole[a:b])


@pytest.mark.parametrize("K", [576, 40])  # K % 32: AMX's tail tiles
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_silu_in_the_amx_epilogue_equals_the_two_ops(panel_kernels, K, bias):
    """PackedLinear.silu_and_mul (panel_linear_silu_mul): silu(gate) * up from the AMX path's
    epilogue, bit-equal to panel_linear then silu_and_mul for 1-100 rows (16-row tiles and the
    tile of the rest); None with oneDNN's copy or I not a multiple of 32."""
    if panel_kernels.panel_isa() != "amx-bf16":
        pytest.skip("the fused epilogue runs on AMX-BF16")
    torch.manual_seed(K + bias)
    lin = torch.nn.Linear(K, 2 * 64, bias=bias).bfloat16()
    layer = linear.PackedLinear(lin, panel_kernels.pack_panels(lin.weight.detach()), onednn=False)
    for M in (1, 5, 16, 17, 33, 100):
        x = torch.randn(M, K).bfloat16()
        assert torch.equal(layer.silu_and_mul(x), panel_kernels.silu_and_mul(layer(x))), M
    odd = torch.nn.Linear(K, 2 * 48).bfloat16()
    assert (
        linear.PackedLinear(odd, panel_kernels.pack_panels(odd.weight.detach()), onednn=False).silu_and_mul(x) is None
    )
    assert linear.PackedLinear(lin, panel_kernels.pack_panels(lin.weight.detach())).silu_and_mul(x) is None


def test_small_batches_use_panels_and_agree_with_onednn(panel_kernels, tiny_qwen2_dir, monkeypatch):
    """Not batch-invariant: bf16, tied embeddings (qwen2): every linear keeps panels, the lm_head
    a packed copy of the table (which stays plain for the lookup); <= SMALL_BATCH rows run the
    panel kernel, more run oneDNN, and the two agree within bf16 rounding."""
    if not linear.onednn_bf16_fast():
        pytest.skip(
            "oneDNN has no bf16 GEMM on this CPU (AVX2): bf16 linears are panels only "
            "(test_panels_kept_within_the_memory_limit)"
        )
    monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", "0")
    llm = LLM(tiny_qwen2_dir, dtype="bfloat16", kv_cache_memory=0.02)
    model = _model(llm)
    packed = [m for m in model.modules() if isinstance(m, linear.PackedLinear)]
    assert packed and all(m.panels is not None for m in packed)
    head = model.lm_head
    assert head.panels.data_ptr() != model.embed_tokens.weight.data_ptr()
    for rows in (1, 5, linear.SMALL_BATCH):
        x = torch.randn(rows, head.in_features).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, head.packed_weight, None, "none", [], "")
        torch.testing.assert_close(head(x).float(), onednn.float(), atol=2e-2, rtol=2e-2)
    x = torch.randn(linear.SMALL_BATCH + 1, head.in_features).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, head.packed_weight, None, "none", [], "")
    assert torch.equal(head(x), onednn)


def test_panels_kept_within_the_memory_limit(panel_kernels, tiny_llama_dir, monkeypatch):
    """Not batch-invariant: past PANEL_WEIGHTS_MAX_BYTES (or with TOKENMILL_PANEL_WEIGHTS=0) no
    layer keeps panels and oneDNN runs every batch; TOKENMILL_PANEL_WEIGHTS=1 keeps them whatever
    the size. The same greedy text either way (logprobs within bf16 rounding). Batch-invariant,
    or where oneDNN has no bf16 GEMM (AVX2 CPUs), the panels are the only copy, kept whatever the
    size (TOKENMILL_PANEL_WEIGHTS=0 leaves torch's own bf16 linears there)."""

    def panels(llm):
        return [m.panels for m in _model(llm).modules() if isinstance(m, linear.PackedLinear)]

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    kw = dict(dtype="bfloat16", kv_cache_memory=0.02)
    monkeypatch.setattr(linear, "PANEL_WEIGHTS_MAX_BYTES", 1000)
    assert all(p is not None for p in panels(LLM(tiny_llama_dir, **kw)))  # batch-invariant
    monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", "0")
    if not linear.onednn_bf16_fast():
        model = _model(LLM(tiny_llama_dir, **kw))
        packed = [m for m in model.modules() if isinstance(m, linear.PackedLinear)]
        assert packed and all(m.panels is not None and m.packed_weight is None for m in packed)
        monkeypatch.setenv("TOKENMILL_PANEL_WEIGHTS", "0")
        assert panels(LLM(tiny_llama_dir, **kw)) == []
        return
    monkeypatch.setattr(linear, "PANEL_WEIGHTS_MAX_BYTES", 1 << 30)
    with_panels = LLM(tiny_llama_dir, **kw)
    assert all(p is not None for p in panels(with_panels))
    monkeypatch.setattr(linear, "PANEL_WEIGHTS_MAX_BYTES", 1000)
    without = LLM(tiny_llama_dir, **kw)
    assert all(p is None for p in panels(without))
    assert without.engine.core.runner.fast_decode is None
    monkeypatch.setenv("TOKENMILL_PANEL_WEIGHTS", "1")
    assert all(p is not None for p in panels(LLM(tiny_llama_dir, **kw)))
    for a, b in zip(
        with_panels.generate(["Hello world", "The sky is"], params),
        without.generate(["Hello world", "The sky is"], params),
    ):
        la = next(iter(a.outputs[0].logprobs[0].values())).logprob
        lb = next(iter(b.outputs[0].logprobs[0].values())).logprob
        assert abs(la - lb) < 0.05  # the first token's logprob: same weights, another summation order
