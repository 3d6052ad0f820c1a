"""--quantization w8a8: the int8 x int8 kernel against a dequantized float reference (ragged shapes,
rows batch-invariant), SmoothQuant's folding (function-preserving), the calibration cache, and the
w8a8 model's greedy tokens against a float model with the same fake-quantized weights and
activations. Quality figures are the benchmark's (benchmarks/w8a8.py), not asserted here."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPTS
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.model import smoothquant
from tokenmill.model.layers.bind import bind_kernels
from tokenmill.model.layers.w8a8 import W8A8Linear, pack, quantize_activations, quantize_weight, reference, unpack

SHAPES = [
    (1, 1, 4),
    (1, 16, 64),
    (3, 17, 37),
    (4, 40, 100),
    (5, 15, 576),
    (9, 33, 128),
    (17, 64, 64),
    (33, 7, 20),
    (70, 50, 192),
]


def _model(llm: LLM) -> nn.Module:
    return llm.engine.core.runner.model


def _fake_quant_x(x: torch.Tensor, other_at_ties: bool = False) -> torch.Tensor:
    """The oracle's activations: per token, 8-bit asymmetric over [min(x, 0), max(x, 0)], dequantized
    in float64 (the integers of quantize_activations, whose error bound the first test checks).
    other_at_ties: every activation whose x * inv lies within float32 rounding (a few ulps) of a half
    step takes the other code: what another evaluation of the same float32 formula (another ISA's
    instructions, an FMA) may give; the one-step effect the last test's bound is derived from."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    u, s, z = quantize_activations(rows)
    if other_at_ties:
        v = rows.float() * (1 / s).unsqueeze(1)  # quantize_activations' x * inv (inv = 1 / s; s = 1 where 0)
        near = ((v - v.floor()) - 0.5).abs() <= TIE_ULPS * torch.finfo(torch.float32).eps * v.abs().clamp_min(1)
        other = torch.where(v.round() == v.floor(), v.floor() + 1, v.floor())
        u = torch.where(near, (other + z.unsqueeze(1)).clamp(0, 255), u.float()).to(torch.uint8)
    return ((u.double() - z.double().unsqueeze(1)) * s.double().unsqueeze(1)).reshape(shape)


TIE_ULPS = 4  # how close to a half step another float32 evaluation of x * inv may round the other way


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_weight(w)
    return q.double() * s.double().unsqueeze(1)


def test_weight_and_activation_quantization_round_trip() -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 70)
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and s.shape == (37,)
    assert ((q.float() * s.unsqueeze(1) - w).abs() <= s.unsqueeze(1) / 2 + 1e-6).all()
    assert torch.equal(unpack(pack(q), 37, 70), q)
    x = torch.randn(5, 70) * torch.tensor([3.0, 0.1, 1.0, 10.0, 0.0]).unsqueeze(1)
    u, sx, z = quantize_activations(x)
    back = (u.float() - z.float().unsqueeze(1)) * sx.unsqueeze(1)
    assert ((back - x).abs() <= sx.unsqueeze(1) / 2 + 1e-6).all()
    assert torch.equal(back[4], torch.zeros(70))  # an all-zero row stays zero
    assert (z >= 0).all() and (z <= 255).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantizes_activations_like_torch(kernels, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    for M, K in [(1, 1), (3, 37), (7, 64), (2, 100), (4, 576)]:
        x = (torch.randn(M, K) * torch.rand(M, 1) * 4 + torch.randn(M, 1)).to(dtype)
        for a, b in zip(kernels.w8a8_quantize_activations(x), quantize_activations(x)):
            assert torch.equal(a, b), (M, K)
    # s = 7.96875 / 255 = 1 / 32 in float32, so 3.484375 / s = 111.5: inv = 1 / s = 32 gives the tie
    # (to even: 112); (1 / c) / d = 31.999998, what -ffast-math made of 1 / s on some CPUs, gives 111
    x = torch.tensor([[7.96875, 3.484375] + [0.0] * 38]).to(dtype)
    for a, b in zip(kernels.w8a8_quantize_activations(x), quantize_activations(x)):
        assert torch.equal(a, b)
    assert quantize_activations(x)[0][0, 1] == 112


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_dequantized_reference(kernels, dtype: torch.dtype, bias: bool) -> None:
    """y = fakequant(x) @ dequant(W)^T (+ bias) in float64, on ragged M, N and K."""
    torch.manual_seed(2)
    for M, N, K in SHAPES:
        w, x = torch.randn(N, K) * 0.1, (torch.randn(M, K) * 2).to(dtype)
        b = torch.randn(N) if bias else None
        layer = W8A8Linear(w, b)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (M, N)
        ref = _fake_quant_x(x) @ _dequantized(w).T + (b.double() if bias else 0)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        # and the torch path (no C++ kernels) computes the same integers and epilogue
        torch.testing.assert_close(
            out, reference(x, layer.weight_int8(), layer.w_scale, layer.bias), rtol=tol, atol=tol
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gives_each_row_the_bits_it_has_alone(kernels, dtype: torch.dtype) -> None:
    """Rows alone vs in batches of every size and offset (tails of the row tiles), outputs not a
    multiple of the 16-row panels: bit-equal."""
    torch.manual_seed(3)
    N, K = 1541, 576
    layer = W8A8Linear(torch.randn(N, K) * 0.05, torch.randn(N))
    x = torch.randn(40, K).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for M in (2, 3, 4, 5, 7, 8, 9, 16, 40):
        for start in (0, 1, 3):
            out = layer(x[start : start + M])
            assert torch.equal(out, alone[start : start + len(out)]), (M, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,inter", [(576, 96), (40, 48)])  # AMX blocks where K % 64 == 0; VNNI tiles otherwise
def test_gate_up_with_silu_in_the_epilogue_equals_the_two_ops(kernels, dtype: torch.dtype, K: int, inter: int) -> None:
    """W8A8Linear.silu_and_mul (w8a8_linear_silu_mul): silu(gate) * up from the kernel's epilogue,
    bit-equal to forward() then silu_and_mul, for every row count (the tails of 16- and 32-row
    blocks), with and without bias; None where it cannot run (I not a multiple of 16)."""
    if not hasattr(kernels, "w8a8_linear_silu_mul") or kernels.w8a8_isa() not in ("amx-int8", "avx512-vnni"):
        pytest.skip("the fused epilogue runs on AVX-512 builds")
    torch.manual_seed(K + inter)
    for bias in (None, torch.randn(2 * inter)):
        layer = W8A8Linear(torch.randn(2 * inter, K) * 0.05, bias)
        for M in (1, 5, 16, 17, 31, 32, 33, 70):
            x = (torch.randn(M, K) * 2).to(dtype)
            want = kernels.silu_and_mul(layer(x))
            got = layer.silu_and_mul(x)
            assert torch.equal(got, want), (M, bias is None)
    assert W8A8Linear(torch.randn(2 * 24, K)).silu_and_mul(torch.randn(3, K).to(dtype)) is None
    with pytest.raises(RuntimeError, match="multiple of"):
        kernels.w8a8_linear_silu_mul(torch.randn(3, K), layer.packed, layer.w_scale, layer.rowsum, None, 2 * inter + 2)


def test_torch_fallback_matches_kernel(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    layer = W8A8Linear(torch.randn(24, 64), torch.randn(24))
    x = torch.randn(10, 64)
    with_kernel = layer(x)
    layer.bind_kernels(None)  # the torch path
    torch.testing.assert_close(layer(x), with_kernel, rtol=1e-6, atol=1e-6)


# ---- smoothing and the model ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("tm-w8a8-cache")
        mp.setenv("TOKENMILL_CACHE_DIR", str(path))
        yield path


def _logits(llm: LLM, prompts=PROMPTS) -> list[torch.Tensor]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    return [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_preserves_the_function(arch: str, request: pytest.FixtureRequest, cache_dir) -> None:
    """Folding the factors (into the norms, v's rows for o_proj, up's rows for down_proj) changes the
    weights but not the model: GQA (llama: 4 heads on 2 kv heads), q/k/v biases (qwen2)."""
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = LLM(path, dtype="float32", kv_cache_memory=0.02)
    before = _logits(llm)
    model = _model(llm)
    maxima = smoothquant.cached_input_maxima(model, path, None)
    assert len(maxima) == 4 * len(model.layers)
    old = model.layers[0].self_attn.o_proj.weight.clone()
    smoothquant.smooth(model, maxima, 0.5)
    assert not torch.allclose(model.layers[0].self_attn.o_proj.weight, old)
    for a, b in zip(before, _logits(llm)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)


class _FakeQuantLinear(nn.Module):
    """The oracle: the same int8 weights dequantized, activations fake-quantized per token, float64."""

    def __init__(self, layer: W8A8Linear, other_at_ties: bool = False):
        super().__init__()
        self.w = layer.weight_int8().double() * layer.w_scale.double().unsqueeze(1)
        self.b = None if layer.bias is None else layer.bias.double()
        self.other_at_ties = other_at_ties

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_fake_quant_x(x, self.other_at_ties), self.w, self.b).to(x.dtype)


def _fake_quantized(tiny_llama_dir, other_at_ties: bool = False) -> LLM:
    oracle = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8")
    for parent in list(_model(oracle).modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, W8A8Linear):
                setattr(parent, name, _FakeQuantLinear(child, other_at_ties))
    bind_kernels(_model(oracle), "cpu", torch.float32)  # modules swapped after load: bound again
    return oracle


def _logprob_diffs(got, want) -> torch.Tensor:
    """|logprob differences| of each sequence's tokens, up to where the tokens first differ."""
    diffs = []
    for a, b in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diffs += [abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob) for i in range(n)]
    return torch.tensor(diffs)


def _greedy(llm: LLM, n: int = 12):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, logprobs=0), use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def w8a8_llama(tiny_llama_dir, cache_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8")


def test_w8a8_model_matches_a_fake_quantized_float_model(tiny_llama_dir, w8a8_llama, cache_dir, monkeypatch) -> None:
    """Greedy tokens equal token for token against the same model with every W8A8Linear (the
    lm_head's too) replaced by float64 fake quantization, and their logprobs close: the median
    within 1e-4, every one within a bound derived from the quantization step. An activation whose
    x * inv lies within float32 rounding of a half step may take the other code in one model (the
    kernels' float32 arithmetic differs by ISA: an AVX2 build flips one code of one prompt here, then
    a later logprob moves by 1.0e-2), so the bound is what such flips do to this model's logprobs:
    twice the largest difference between the oracle and the oracle with every near-tie code taken
    the other way, plus 1e-4. Also with prompts chunked over steps. The MLPs take gate/up's fused
    SiLU epilogue where the build has it."""
    fused = []
    real = W8A8Linear.silu_and_mul
    monkeypatch.setattr(W8A8Linear, "silu_and_mul", lambda self, x: fused.append(real(self, x)) or fused[-1])
    model = _model(w8a8_llama)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 4 * len(model.layers) + 1 and isinstance(model.lm_head, W8A8Linear)
    assert isinstance(model.embed_tokens, nn.Embedding)  # the tied table stays in the model's dtype
    chunked = LLM(
        tiny_llama_dir,
        dtype="float32",
        kv_cache_memory=0.02,
        quantization="w8a8",
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    want = _greedy(_fake_quantized(tiny_llama_dir))
    tie_effect = _logprob_diffs(_greedy(_fake_quantized(tiny_llama_dir, other_at_ties=True)), want).max().item()
    bound = 1e-4 + 2 * tie_effect
    assert bound < 0.1  # a code flip moves a logprob by a fraction of a step, not more
    assert max(len(p) for p in PROMPTS) > 8  # the long prompt is split over steps
    for llm in (w8a8_llama, chunked):
        got = _greedy(llm)
        assert [a.token_ids for a in got] == [b.token_ids for b in want]
        diffs = _logprob_diffs(got, want)
        assert diffs.median() < 1e-4 and diffs.max() < bound, (diffs.median(), diffs.max(), bound)
    kernels = cpu_kernels.load()
    if kernels is not None and kernels.w8a8_isa() in ("amx-int8", "avx512-vnni"):
        assert fused and all(y is not None for y in fused)


def test_tied_lm_head_in_int8_and_the_switch_to_keep_it_float(tiny_qwen2_dir, cache_dir, monkeypatch) -> None:
    """A tied lm_head (qwen2) becomes int8 while the embedding table keeps its float weights;
    TOKENMILL_W8A8_LM_HEAD=0 keeps the lm_head float (the layers' linears int8 either way)."""
    kw = dict(dtype="float32", kv_cache_memory=0.02, quantization="w8a8")
    table = _model(LLM(tiny_qwen2_dir, dtype="float32", kv_cache_memory=0.02)).embed_tokens.weight
    on = LLM(tiny_qwen2_dir, **kw)
    model = _model(on)
    assert isinstance(model.lm_head, W8A8Linear) and torch.equal(model.embed_tokens.weight, table)
    monkeypatch.setenv("TOKENMILL_W8A8_LM_HEAD", "0")
    off = LLM(tiny_qwen2_dir, **kw)
    assert not isinstance(_model(off).lm_head, W8A8Linear)
    assert sum(isinstance(m, W8A8Linear) for m in _model(off).modules()) == 4 * len(model.layers)
    diff = torch.cat([(a - b).abs() for a, b in zip(_logits(on), _logits(off))])
    assert 0 < diff.max().item() and diff.mean().item() < 0.1, diff  # the int8 head moves the logprobs, a little


def test_w8a8_is_close_to_the_float_model(tiny_llama_dir, w8a8_llama) -> None:
    """A sanity bound only (int8 everywhere on a random tiny model): the quality figures are the benchmark's."""
    base = _logits(LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02))
    diff = torch.cat([(a - b).abs() for a, b in zip(base, _logits(w8a8_llama))]).mean().item()
    assert diff < 0.1, diff


def test_calibration_is_cached_and_user_files_are_read(tiny_llama_dir, w8a8_llama, cache_dir, tmp_path) -> None:
    files = sorted((cache_dir / "w8a8").glob("*.safetensors"))
    assert files  # the fixture's load calibrated and cached
    LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8")
    assert sorted((cache_dir / "w8a8").glob("*.safetensors")) == files  # the same statistics reused
    user = tmp_path / "calib.jsonl"
    user.write_text(
        "\n".join(
            json.dumps(d)
            for d in (
                {"prompt": "def add(a, b):\n    return a + b"},
                "The quick brown fox jumps over the lazy dog.",
                {"messages": [{"role": "user", "content": "Hello world!"}]},
            )
        )
    )
    llm = LLM(
        tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8", quantization_calibration=str(user)
    )
    assert len(sorted((cache_dir / "w8a8").glob("*.safetensors"))) == len(files) + 1
    assert llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    text = tmp_path / "calib.txt"
    text.write_text("Paged attention keeps the KV cache in fixed-size blocks. " * 20)
    docs = smoothquant.read_calibration(text)
    assert docs == [{"text": text.read_text()}]


def test_bad_w8a8_combinations_refused(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="--quantization-calibration is for --quantization w8a8"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization_calibration="x.txt")
    with pytest.raises(ValueError, match="--enable-lora is not supported with --quantization w8a8"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8", enable_lora=True)
    with pytest.raises(ValueError, match="w8a8 is not supported with --tensor-parallel-size"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, quantization="w8a8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(
            tiny_llama_dir,
            dtype="float32",
            kv_cache_memory=0.02,
            quantization="w8a8",
            quantization_calibration=str(tmp_path / "missing.jsonl"),
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        smoothquant.read_calibration(bad)
