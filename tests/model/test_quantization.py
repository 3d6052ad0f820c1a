"""Weight-only int4 / int8 quantization: the format, the C++ kernel, GGUF blocks loaded as they
are, `--quantization int4|int8` on HF checkpoints, and a server running a quantized model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPTS, running_server
from gguf_writer import write_gguf_from_hf

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers.quantization import (
    AMX_ROWS,
    LARGE_BATCH,
    QuantEmbedding,
    QuantLinear,
    a8_linear,
    dequantize,
    from_panels,
    pack_quantized,
    quantize,
    quantize_activation_groups,
    to_panels,
)


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.runner.model


def _prompt_logprobs(llm: LLM, prompts=PROMPTS) -> list[torch.Tensor]:
    """Logprob of every prompt token after the first (a teacher-forced view of the whole model)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_round_trip_error_is_half_a_step(bits: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 96)
    qweight, scales = quantize(w, bits)
    assert qweight.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert qweight.shape == (37, 96 // 2 if bits == 4 else 96) and scales.dtype == torch.float16
    step = scales.float()[..., 0] if bits == 4 else scales.float()
    err = (dequantize(qweight, scales, bits) - w).abs().view(37, 3, 32).amax(-1)
    assert (err <= step * 0.5 + 2e-3).all()  # + float16 rounding of the scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_matches_dequantized_matmul(bits: int, dtype: torch.dtype) -> None:
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ kernels unavailable")
    torch.manual_seed(1)
    for M, N, K in [(1, 5, 32), (3, 8, 96), (5, 37, 64), (17, 4, 128), (64, 33, 576)]:
        w, x = torch.randn(N, K) * 0.1, torch.randn(M, K).to(dtype)
        qweight, scales = quantize(w, bits)
        ref = F.linear(x.float(), dequantize(qweight, scales, bits).to(dtype).float())
        out = kernels.quant_linear(x, qweight, scales, bits)
        assert out.dtype == dtype and out.shape == (M, N)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_gives_each_row_the_bits_it_has_alone(bits: int, dtype: torch.dtype) -> None:
    """Batch invariance of the tile kernel: a row's outputs are the same bits whatever the number of
    rows in the call and the row's place in its tile of 4 (every output summed through one tree,
    full tiles and tails alike); N not a multiple of 4, so tails of outputs too."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ kernels unavailable")
    torch.manual_seed(3)
    N, K = 1541, 576  # bf16 outputs: rounding hides most float32 differences, so many outputs
    qweight, scales = quantize(torch.randn(N, K) * 0.1, bits)
    x = torch.randn(40, K).to(dtype)
    alone = torch.cat([kernels.quant_linear(x[i : i + 1], qweight, scales, bits) for i in range(len(x))])
    for M in (2, 3, 4, 5, 7, 8, 40):
        for start in (0, 1, 2):
            out = kernels.quant_linear(x[start : start + M], qweight, scales, bits)
            assert torch.equal(out, alone[start : start + len(out)]), (M, start)


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_on_random_shapes_matches_reference_and_is_row_invariant(bits: int) -> None:
    """Random shapes with ragged output tails and 1..40 bf16 rows: close to the dequantized float
    matmul, and each row the bits of that row alone (few rows dequantize in registers, more go
    through an L1 buffer: both paths must sum alike)."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("C++ kernels unavailable")
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        N = int(torch.randint(1, 70, (1,), generator=gen))
        K = 32 * int(torch.randint(1, 50, (1,), generator=gen))
        M = int(torch.randint(1, 41, (1,), generator=gen))
        w = torch.randn(N, K, generator=gen) * 0.1
        x = torch.randn(M, K, generator=gen).bfloat16()
        qweight, scales = quantize(w, bits)
        out = kernels.quant_linear(x, qweight, scales, bits)
        ref = F.linear(x.float(), dequantize(qweight, scales, bits))
        torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
        f32 = kernels.quant_linear(x.float(), qweight, scales, bits)
        torch.testing.assert_close(f32, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
        alone = torch.cat([kernels.quant_linear(x[i : i + 1], qweight, scales, bits) for i in range(M)])
        assert torch.equal(out, alone), (M, N, K)


def _panel_kernels():
    kernels = cpu_kernels.load()
    if kernels is None or not hasattr(kernels, "quant_panel_linear"):
        pytest.skip("no output-panel kernel here (builds with AVX2 + FMA + F16C only)")
    kernels.set_quant_amx_rows(LARGE_BATCH)  # the default (a model loaded before may have set another)
    return kernels


def _amx_kernels():
    kernels = _panel_kernels()
    if not kernels.quant_panels_amx(1 << 40):
        pytest.skip("the panels run on AMX tiles only where the CPU has AMX-BF16")
    return kernels


@pytest.mark.parametrize("bits", [4, 8])
def test_panels_are_the_same_codes_reordered(bits: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for N in (1, 31, 32, 45, 70):
        qweight, scales = quantize(torch.randn(N, 96, generator=gen), bits)
        qp, sp = to_panels(qweight, scales, bits)
        assert qp.shape[:3] == (-(-N // 32), 3, 32) and qp.numel() * qp.element_size() <= 32 * qp.shape[0] * 96
        back = from_panels(qp, sp, bits, N)
        assert torch.equal(back[0], qweight) and torch.equal(back[1], scales)


@pytest.mark.parametrize("bits", [4, 8])
def test_panel_kernel_on_random_shapes_matches_reference_and_is_invariant(bits: int) -> None:
    """The output-panel kernel: random shapes (K a multiple of 32, N ragged, 1..40 rows), bf16 and
    float32 inputs, close to the float64 reference with the activations quantized to int8 per group
    (a8_linear); each row the bits it has alone, in any batch and at any thread count; embedding
    rows read from the panels exact."""
    kernels = _panel_kernels()
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    for _ in range(6):
        N = int(torch.randint(1, 100, (1,), generator=gen))
        K = 32 * int(torch.randint(1, 50, (1,), generator=gen))
        M = int(torch.randint(1, 41, (1,), generator=gen))
        qweight, scales = quantize(torch.randn(N, K, generator=gen) * 0.1, bits)
        qp, sp = to_panels(qweight, scales, bits)
        w = dequantize(qweight, scales, bits)
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
            x = torch.randn(M, K, generator=gen).to(dtype)
            out = kernels.quant_panel_linear(x, qp, sp, bits, N)
            ref = a8_linear(x.float(), qweight, scales, bits).float()
            assert out.dtype == dtype and out.shape == (M, N)
            torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
            alone = torch.cat([kernels.quant_panel_linear(x[i : i + 1], qp, sp, bits, N) for i in range(M)])
            assert torch.equal(out, alone), (M, N, K, dtype)
            for start in (0, 1):
                part = kernels.quant_panel_linear(x[start : start + 7], qp, sp, bits, N)
                assert torch.equal(part, alone[start : start + len(part)])
            try:
                torch.set_num_threads(1)
                assert torch.equal(kernels.quant_panel_linear(x, qp, sp, bits, N), out)
            finally:
                torch.set_num_threads(threads)
        ids = torch.randint(0, N, (5,), generator=gen)
        assert torch.equal(kernels.quant_embedding(ids, qp, sp, bits, torch.bfloat16, N), w[ids].bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_rows_take_the_panels_dequantized_to_bf16(bits: int) -> None:
    """From set_quant_amx_rows' rows a bf16 call runs on AMX tiles over each panel dequantized to
    bf16 (q * d + m, rounded once to bf16: quant_embedding's numbers): random shapes, K a multiple
    of 32, N ragged, 1..40 rows and 130 (whole tiles of 16 and a rest), close to the float64 product
    of the bf16 rows and those weights (bf16's rounding of the outputs); each row the bits it has
    alone (1-row tiles) and in any slice, at any thread count. Below the threshold the int8
    products run, and float32 inputs take them at any size."""
    kernels = _amx_kernels()
    gen = torch.Generator().manual_seed(12)
    threads = torch.get_num_threads()
    try:
        for M in [int(torch.randint(1, 41, (1,), generator=gen)) for _ in range(4)] + [130]:
            N = int(torch.randint(1, 100, (1,), generator=gen))
            K = 32 * int(torch.randint(1, 50, (1,), generator=gen))
            qweight, scales = quantize(torch.randn(N, K, generator=gen) * 0.1, bits)
            qp, sp = to_panels(qweight, scales, bits)
            w = dequantize(qweight, scales, bits).bfloat16()
            assert torch.equal(kernels.quant_embedding(torch.arange(N), qp, sp, bits, torch.bfloat16, N), w)
            x = torch.randn(M, K, generator=gen).bfloat16()
            kernels.set_quant_amx_rows(M + 1)
            below = kernels.quant_panel_linear(x, qp, sp, bits, N)
            a8 = a8_linear(x.float(), qweight, scales, bits).float()
            torch.testing.assert_close(below.float(), a8, atol=1e-2 * a8.abs().max().item(), rtol=1e-2)
            kernels.set_quant_amx_rows(1)
            out = kernels.quant_panel_linear(x, qp, sp, bits, N)
            ref = x.double() @ w.double().T
            torch.testing.assert_close(out.double(), ref, atol=1e-3 * ref.abs().max().item(), rtol=2**-8)
            assert not torch.equal(out, below)  # (the int8 activations round otherwise)
            alone = torch.cat([kernels.quant_panel_linear(x[i : i + 1], qp, sp, bits, N) for i in range(M)])
            assert torch.equal(out, alone), (M, N, K)
            for start, n in ((1, 7), (2, 17), (0, 33)):
                part = kernels.quant_panel_linear(x[start : start + n], qp, sp, bits, N)
                assert torch.equal(part, alone[start : start + len(part)])
            torch.set_num_threads(1)
            assert torch.equal(kernels.quant_panel_linear(x, qp, sp, bits, N), out)
            torch.set_num_threads(threads)
            f32 = kernels.quant_panel_linear(x.float(), qp, sp, bits, N)
            kernels.set_quant_amx_rows(M + 1)
            assert torch.equal(kernels.quant_panel_linear(x.float(), qp, sp, bits, N), f32)
            kernels.set_quant_amx_rows(M)
            assert torch.equal(kernels.quant_panel_linear(x, qp, sp, bits, N), out)
    finally:
        torch.set_num_threads(threads)
        kernels.set_quant_amx_rows(LARGE_BATCH)


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_int8_products_give_the_vector_paths_bits(bits: int) -> None:
    """Calls of set_quant_amx_int_rows' rows or more take each group's integer sums from AMX-INT8
    tiles (int8 activations, as the vector path): the same bits as that path (the rows alone, 1-row
    calls, and with the tiles switched off) for 16-70 rows (whole blocks of 32, tiles of fewer rows),
    bf16 and float32, and close to the float64 reference."""
    kernels = _panel_kernels()
    # the loaded level's answer, not the CPU's flags: TOKENMILL_CPU_ISA may cap an AMX machine below AMX
    if not hasattr(kernels, "quant_panels_amx_int") or not kernels.quant_panels_amx_int(1 << 40):
        pytest.skip(
            "the int8 products run on AMX-INT8 tiles only where the CPU has them and the kernels' level uses them"
        )
    rows = kernels.QUANT_AMX_INT_ROWS
    assert rows == 16 and kernels.quant_panels_amx_int(rows) and not kernels.quant_panels_amx_int(rows - 1)
    gen = torch.Generator().manual_seed(13)
    try:
        for M in (16, 17, 31, 32, 33, 48, 70):
            N = int(torch.randint(1, 100, (1,), generator=gen))
            K = 32 * int(torch.randint(1, 50, (1,), generator=gen))
            qweight, scales = quantize(torch.randn(N, K, generator=gen) * 0.1, bits)
            qp, sp = to_panels(qweight, scales, bits)
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(M, K, generator=gen).to(dtype)
                out = kernels.quant_panel_linear(x, qp, sp, bits, N)
                ref = a8_linear(x.float(), qweight, scales, bits).float()
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
                alone = torch.cat([kernels.quant_panel_linear(x[i : i + 1], qp, sp, bits, N) for i in range(M)])
                assert torch.equal(out, alone), (M, N, K, dtype)
                kernels.set_quant_amx_int_rows(1 << 40)
                assert torch.equal(kernels.quant_panel_linear(x, qp, sp, bits, N), out)
                kernels.set_quant_amx_int_rows(rows)
    finally:
        kernels.set_quant_amx_int_rows(kernels.QUANT_AMX_INT_ROWS)


@pytest.mark.parametrize("invariant", [True, False])
def test_pack_quantized_sets_the_amx_rows(invariant: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch-invariant, the int4 / int8 panels switch to the AMX tiles at LARGE_BATCH rows (below it
    a row's bits never depend on its batch); otherwise where the tiles are faster."""
    kernels = _amx_kernels()
    monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", "1" if invariant else "0")
    model = torch.nn.Module()
    model.proj = QuantLinear.from_linear(torch.nn.Linear(64, 40), 4)
    try:
        assert pack_quantized(model) == 1
        rows = AMX_ROWS[invariant]
        assert rows == (LARGE_BATCH if invariant else AMX_ROWS[False]) and AMX_ROWS[False] < LARGE_BATCH
        assert not kernels.quant_panels_amx(rows - 1) and kernels.quant_panels_amx(rows)
    finally:
        kernels.set_quant_amx_rows(LARGE_BATCH)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layer_computes_the_layer_it_was(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_quantized: the layer in panels computes its weights with the activations in int8 at
    every batch size (the float64 reference, each row as alone; within 2% of the float activations
    the rows computed), a tied table reads the LM head's panels, and the pure-torch fallback
    computes what the panels' kernel does."""
    _panel_kernels()
    torch.manual_seed(4)
    model = torch.nn.Module()
    model.lm_head = QuantLinear.from_linear(torch.nn.Linear(64, 45, bias=True), bits)
    model.embed_tokens = QuantEmbedding(model.lm_head.qweight, model.lm_head.scales, bits, torch.float32)
    x, ids = torch.randn(200, 64), torch.tensor([0, 44, 7])
    small, large, rows = model.lm_head(x[:9]), model.lm_head(x), model.embed_tokens(ids)
    w, qweight, scales = model.lm_head.dequantized(), model.lm_head.qweight, model.lm_head.scales
    assert pack_quantized(model) == 1 and model.lm_head.panels and model.embed_tokens.qweight is model.lm_head.qweight
    assert torch.equal(model.lm_head.dequantized(), w) and torch.equal(model.embed_tokens(ids), rows)
    ref = (a8_linear(x, qweight, scales, bits) + model.lm_head.bias.double()).float()
    out = model.lm_head(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:9], model.lm_head(x[:9]))
    # int8 activations cost little: within 2% of the largest output of the float activations' layer
    torch.testing.assert_close(out, large, atol=0.02 * large.abs().max().item(), rtol=0.02)
    torch.testing.assert_close(out[:9], small, atol=0.02 * small.abs().max().item(), rtol=0.02)
    ref = ref[:9]
    model.lm_head.bind_kernels(None)  # the pure-torch fallback reads panels too
    torch.testing.assert_close(model.lm_head(x[:9]), ref, atol=1e-4, rtol=1e-4)


def test_activation_codes_use_the_int8_range_without_overflow() -> None:
    """quantize_activation_groups: codes in [-127, 127], the group's largest |x| at +-127, zero groups zero;
    the panel kernel at the extremes of its integer sums (int4: every code 15; int8: every code
    +-127 or -128, whose |w| only fits unsigned) with every activation at +-max, and with outliers,
    equals the float64 reference."""
    kernels = _panel_kernels()
    x = torch.tensor([[1.0] * 32 + [0.0] * 32 + [-3.0] * 16 + [3.0] * 16, [0.5] * 96])
    codes, xs = quantize_activation_groups(x)
    assert codes.abs().max() == 127 and torch.equal(codes[0, 1], torch.zeros(32)) and xs[0, 1] == 0
    assert torch.equal(codes[0, 2], torch.tensor([-127.0] * 16 + [127.0] * 16))
    N, K = 40, 96
    gen = torch.Generator().manual_seed(3)
    xs = (
        torch.full((3, K), 7.0),
        torch.full((3, K), -7.0),
        torch.randn(9, K, generator=gen) * torch.tensor([1e3] + [1.0] * 95),
    )
    weights = [
        (
            4,
            torch.full((N, K // 2), 0xFF, dtype=torch.uint8),  # every code 15
            torch.stack([torch.full((N, K // 32), 0.01), torch.full((N, K // 32), -0.05)], -1).half(),
        )
    ]
    for code in (127, -127, -128):
        weights.append((8, torch.full((N, K), code, dtype=torch.int8), torch.full((N, K // 32), 0.01).half()))
    for bits, qweight, scales in weights:
        qp, sp = to_panels(qweight, scales, bits)
        for xx in xs:
            out = kernels.quant_panel_linear(xx, qp, sp, bits, N)
            torch.testing.assert_close(out.double(), a8_linear(xx, qweight, scales, bits), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_torch_fallback_matches_kernel(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small batches (the tile kernel), large ones (a dequantized copy through oneDNN) and the
    pure-torch fallback compute the same layer."""
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 24, bias=True)
    q = QuantLinear.from_linear(lin, bits)
    x = torch.randn(200, 64)
    small, large = torch.cat([q(x[i : i + 8]) for i in range(0, 200, 8)]), q(x)
    torch.testing.assert_close(large, small, atol=1e-4, rtol=1e-4)
    q.bind_kernels(None)  # the pure-torch fallback
    torch.testing.assert_close(q(x), small, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,qtype,bits", [("llama", "Q4_1", 4), ("llama", "Q4_0", 4), ("qwen2", "Q8_0", 8)])
def test_gguf_blocks_load_without_dequantizing(
    arch: str, qtype: str, bits: int, request: pytest.FixtureRequest, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization gguf keeps the file's blocks: every QuantLinear stands for exactly the weight
    the dense (dequantized) load produces, and both models score prompts alike (float activations:
    the row kernel; where the panels run, their int8 activations cost a little more)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf_from_hf(request.getfixturevalue(f"tiny_{arch}_dir"), tmp_path / f"m.{qtype}.gguf", qtype)
    dense = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    if cpu_kernels.load() is not None and hasattr(cpu_kernels.load(), "quant_panel_linear"):
        a8 = LLM(str(path), dtype="float32", kv_cache_memory=0.02, quantization="gguf")
        assert _model(a8).layers[0].mlp.down_proj.panels
        diff = torch.cat([(a - b).abs() for a, b in zip(_prompt_logprobs(dense), _prompt_logprobs(a8))])
        # ~0.07-0.09 nats on average here, <= 0.9 at most (a wiring error costs nats on every token)
        assert diff.mean() < 0.2 and diff.max() < 2.0, diff
        del a8
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")
    quant = LLM(str(path), dtype="float32", kv_cache_memory=0.02, quantization="gguf")
    dense_params = dict(_model(dense).named_parameters())
    linears = {n: m for n, m in _model(quant).named_modules() if isinstance(m, QuantLinear)}
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the lm_head
    for name, m in linears.items():
        assert m.bits == bits
        dense_w = dense_params.get(name + ".weight", dense_params.get("embed_tokens.weight"))  # tied lm_head
        torch.testing.assert_close(m.dequantized(), dense_w, rtol=0, atol=0)
    if arch == "qwen2":  # tied: the embedding table and the lm_head share one set of Q8_0 blocks
        assert isinstance(_model(quant).embed_tokens, QuantEmbedding)
        assert _model(quant).lm_head.qweight is _model(quant).embed_tokens.qweight
        assert _model(quant).layers[0].self_attn.qkv_proj.bias is not None  # float bias loaded by name
    for a, b in zip(_prompt_logprobs(dense), _prompt_logprobs(quant)):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


def test_hf_checkpoint_quantized_at_load(tiny_qwen2_dir: str) -> None:
    """int8 and int4 on an HF folder: linear layers quantized (the lm_head at int8 even for int4),
    the weights take a quarter / half of the bytes, and int4 costs more accuracy than int8."""
    base = LLM(tiny_qwen2_dir, dtype="bfloat16", kv_cache_memory=0.02)
    ref = _prompt_logprobs(base)
    dense_bytes = sum(
        2 * m.in_features * m.out_features for n, m in _model(base).named_modules() if n.endswith("proj")
    )  # bfloat16
    diffs = {}
    for method, bits in (("int8", 8), ("int4", 4)):
        llm = LLM(tiny_qwen2_dir, dtype="bfloat16", kv_cache_memory=0.02, quantization=method)
        model = _model(llm)
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
        assert isinstance(model.embed_tokens, QuantEmbedding)  # tied to the lm_head
        projs = [m for n, m in model.named_modules() if isinstance(m, QuantLinear) and "proj" in n]
        assert projs and all(m.bits == bits for m in projs)
        qbytes = sum(m.qweight.numel() + 2 * m.scales.numel() for m in projs)
        assert qbytes < dense_bytes * (0.32 if bits == 4 else 0.57)
        diffs[method] = torch.cat([(a - b).abs() for a, b in zip(ref, _prompt_logprobs(llm))]).mean().item()
    assert diffs["int8"] < 0.05 and diffs["int4"] < 0.5, diffs
    assert diffs["int8"] < diffs["int4"], diffs


def test_bad_quantization_choices_refused(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="int3")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="gguf")


def test_server_serves_an_int4_model(tiny_llama_dir: str) -> None:
    import openai

    with running_server(tiny_llama_dir, quantization="int4") as (server, aengine):
        assert isinstance(aengine.engine.core.runner.model.layers[0].mlp.down_proj, QuantLinear)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(
            model=aengine.engine.config.model.name, prompt="Hello world", max_tokens=8, temperature=0
        )
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"


def test_converted_folder_stays_a_plain_hf_folder(smollm2_dir: str) -> None:
    """The GGUF blocks live in a subfolder: tools that load every top-level *.safetensors (vLLM,
    transformers) see only the dequantized weights."""
    import glob
    import os

    from safetensors import safe_open

    for f in glob.glob(os.path.join(smollm2_dir, "*.safetensors")):
        with safe_open(f, framework="pt") as st:
            assert not any(k.endswith((".qweight", ".scales")) for k in st.keys())
    assert os.path.exists(os.path.join(smollm2_dir, "gguf_blocks", "model.safetensors"))
