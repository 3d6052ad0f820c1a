"""Pre-quantized AWQ and GPTQ checkpoints (model/quantized_checkpoint.py): folders packed here from
a tiny random Llama per the published layouts (auto-gptq / GPTQModel / optimum's GPTQ, AutoAWQ's
GEMM), loaded with no flag, against an oracle folder of the dequantized float weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from hf_oracle import check_against_hf
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.quantization import QuantLinear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    # hidden 128 / intermediate 256: every linear has 128+ inputs, so groups of 32, 64 and 128 all fit
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-128"), "llama", hidden_size=128, intermediate_size=256)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> int32 with the same bits."""
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: int [K, N] codes -> int32 [K * bits / 32, N], inputs r * n + j at bit j * bits of row r."""
    n = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // n, n, q.shape[1])
    return _to_int32(sum(q[:, j] << (bits * j) for j in range(n)))


def _pack_cols(q: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int [R, N] -> int32 [R, N * bits / 32]: word c holds column c * n + order[j] at bit j * bits."""
    n = 32 // bits
    order = order or list(range(n))
    q = q.to(torch.int64).reshape(q.shape[0], q.shape[1] // n, n)
    return _to_int32(sum(q[..., order[j]] << (bits * j) for j in range(n)))


def _quantize_groups(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """w [N, K] -> codes int [K, N], zeros int [groups, N], float16 scales [groups, N] (GPTQ's min/max
    rule; sym: zero at the middle code), the float32 [N, K] weight they stand for, and the one our
    int4 format stands for (w = q * s + m, the offset m = -z * s rounded to float16)."""
    maxq = 2**bits - 1
    wt = w.T.float()  # [K, N]
    scales = torch.empty(groups, w.shape[0])
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            scales[g] = 2 * hi / maxq
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (hi - lo) / maxq
            zeros[g] = torch.round(-lo / scales[g]).to(torch.int64)
    scales = scales.half()
    s, z = scales.float()[g_idx], zeros[g_idx]
    q = torch.clamp(torch.round(wt / s) + z, 0, maxq).to(torch.int64)
    q41 = q.float() * s + (-(z.float() * s)).half().float()
    return q, zeros, scales, ((q - z).float() * s).T.contiguous(), q41.T.contiguous()


def _write_folder(base: Path, out: Path, tensors: dict[str, torch.Tensor], qconfig: dict | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((base / "config.json").read_text())
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def make_gptq(base: Path, out: Path, bits: int, group: int, sym: bool, desc_act: bool, fmt: str = "gptq") -> Path:
    """A GPTQ folder of `base` (and `out`-dequant: the float oracle). desc_act: each linear's inputs in
    a random order, g_idx the group of each input in that order (as act-order writes it)."""
    src = load_file(str(base / "model.safetensors"))
    quant, dense, q41 = dict(src), dict(src), dict(src)
    gen = torch.Generator().manual_seed(bits * 1000 + group)
    for name in list(src):
        if not name.endswith(".weight") or not any(f".{p}." in name for p in LINEARS):
            continue
        stem, w = name.removesuffix(".weight"), src[name]
        K = w.shape[1]
        order = torch.randperm(K, generator=gen) if desc_act else torch.arange(K)
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[order] = torch.arange(K) // group
        groups = K // group
        q, zeros, scales, dense[name], q41[name] = _quantize_groups(w, g_idx, groups, bits, sym)
        assert fmt == "gptq_v2" or zeros.min() >= 1  # v1 keeps zero - 1: a zero of 0 cannot be written
        del quant[name]
        quant[stem + ".qweight"] = _pack_rows(q, bits)
        quant[stem + ".qzeros"] = _pack_cols(zeros - 1 if fmt == "gptq" else zeros, bits)
        quant[stem + ".scales"] = scales
        quant[stem + ".g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": desc_act}
    qc["checkpoint_format"] = fmt
    _write_folder(base, out.with_name(out.name + "-dequant"), dense, None)
    _write_folder(base, out.with_name(out.name + "-q41"), q41, None)
    return _write_folder(base, out, quant, qc)


def make_awq(base: Path, out: Path, group: int) -> Path:
    """An AutoAWQ GEMM folder (4 bits, zero points) and its float oracle."""
    src = load_file(str(base / "model.safetensors"))
    quant, dense, q41 = dict(src), dict(src), dict(src)
    for name in list(src):
        if not name.endswith(".weight") or not any(f".{p}." in name for p in LINEARS):
            continue
        stem, w = name.removesuffix(".weight"), src[name]
        K = w.shape[1]
        q, zeros, scales, dense[name], q41[name] = _quantize_groups(w, torch.arange(K) // group, K // group, 4, False)
        del quant[name]
        quant[stem + ".qweight"] = _pack_cols(q, 4, AWQ_ORDER)  # [K, N / 8]
        quant[stem + ".qzeros"] = _pack_cols(zeros, 4, AWQ_ORDER)
        quant[stem + ".scales"] = scales
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _write_folder(base, out.with_name(out.name + "-dequant"), dense, None)
    _write_folder(base, out.with_name(out.name + "-q41"), q41, None)
    return _write_folder(base, out, quant, qc)


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.core.runner.model


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens (12 per prompt) and the prompt tokens' logprobs."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [torch.tensor([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]]) for o in outs]


def _compare(path: Path, native: bool) -> None:
    """Dequantized at load: greedy tokens and logprobs as the float model of the checkpoint's exact
    values. Native (our int4 layers, float activations): as the float model of what our format holds
    (offsets rounded to float16), and that differs from the exact values by the offsets' rounding only."""
    quant = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    oracle = LLM(str(path) + ("-q41" if native else "-dequant"), dtype="float32", kv_cache_memory=0.02)
    qtok, qlp = _run(quant)
    otok, olp = _run(oracle)
    assert qtok == otok
    for a, b in zip(qlp, olp):
        torch.testing.assert_close(a, b, atol=2e-3 if native else 1e-5, rtol=0)
    model = _model(quant)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and "layers." in n}
    assert len(layers) == (4 * 2 if native else 0)  # qkv, o, gate_up, down per layer
    if native:
        held = dict(_model(oracle).named_parameters())
        for name, m in layers.items():
            torch.testing.assert_close(m.dequantized(), held[name + ".weight"], atol=1e-6, rtol=0)
        exact = load_file(str(path) + "-dequant/model.safetensors")
        rounded = load_file(str(path) + "-q41/model.safetensors")
        for name, w in exact.items():  # |m| = |z * s| <= 15 s: float16 rounding moves it < 15 s * 2**-11
            if name.endswith("proj.weight"):
                assert ((w - rounded[name]).abs() <= 2e-2 * w.abs().max()).all()


GPTQ_DENSE = [  # (bits, group, sym, desc_act, checkpoint_format): dequantized at load
    (8, 32, False, False, "gptq"),
    (8, 64, False, True, "gptq"),
    (4, 64, False, True, "gptq"),
    (4, 32, True, True, "gptq_v2"),
]
GPTQ_NATIVE = [  # 4 bits / symmetric 8 bits, contiguous groups of a multiple of 32: our int4 / int8 kernels
    (8, 32, True, False, "gptq"),
    (8, 64, True, False, "gptq_v2"),
    (4, 32, True, False, "gptq"),
    (4, 64, False, False, "gptq"),
    (4, 128, False, False, "gptq_v2"),
]


@pytest.mark.parametrize("bits,group,sym,desc_act,fmt", GPTQ_DENSE)
def test_gptq_dequantized_at_load_equals_float_oracle(base_dir, tmp_path, bits, group, sym, desc_act, fmt) -> None:
    path = make_gptq(base_dir, tmp_path / "gptq", bits, group, sym, desc_act, fmt)
    _compare(path, native=False)


@pytest.mark.parametrize("bits,group,sym,desc_act,fmt", GPTQ_NATIVE)
def test_gptq_runs_on_our_kernels(base_dir, tmp_path, monkeypatch, bits, group, sym, desc_act, fmt) -> None:
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")  # float activations: the rows kernel, comparable bits
    path = make_gptq(base_dir, tmp_path / "gptq", bits, group, sym, desc_act, fmt)
    _compare(path, native=True)


TIGHT = dict(dtype="float32", num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=8)


@pytest.mark.parametrize("kind,tp", [("gptq-act-order", 1), ("awq", 1), ("gptq-act-order", 2), ("awq", 2)])
def test_matches_transformers_chunked_preempted_and_tp(base_dir, tmp_path, monkeypatch, kind, tp) -> None:
    """transformers on the oracle folder: greedy tokens and logprobs, with chunked prefill (8-token
    steps) and a KV pool tight enough to preempt; TP=2 (gloo ranks) reads each rank's rows of the
    dequantized weights. AWQ on one rank runs our int4 layers (float activations): its oracle is what they hold."""
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")
    if kind == "awq":
        path, oracle = make_awq(base_dir, tmp_path / "awq", 64), "-dequant" if tp > 1 else "-q41"
    else:
        path, oracle = make_gptq(base_dir, tmp_path / "gptq", 4, 32, False, True), "-dequant"
    llm = LLM(str(path), tensor_parallel_size=tp, device="cpu", **TIGHT)
    try:
        check_against_hf(llm, str(path) + oracle, PROMPTS[:3], 16)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_runs_on_our_kernels(base_dir, tmp_path, monkeypatch, group) -> None:
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")
    _compare(make_awq(base_dir, tmp_path / "awq", group), native=True)


def test_qwen2_biases_and_tied_head(tmp_path, monkeypatch) -> None:
    """Qwen2 (q/k/v biases, tied embeddings): the float biases and the tied table load beside the codes,
    as AWQ (our int4 layers) and as act-order GPTQ (dequantized)."""
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")
    base = build_tiny_model(tmp_path / "qwen2", "qwen2")
    _compare(make_awq(base, tmp_path / "awq", 32), native=True)
    _compare(make_gptq(base, tmp_path / "gptq", 4, 32, False, True), native=False)


@pytest.mark.parametrize("kind", ["awq", "gptq-8-sym"])
def test_int8_activation_panels_stay_close(base_dir, tmp_path, kind) -> None:
    """The default path where the CPU has the panels (int8 activations): close, not equal; GPTQ's
    symmetric 8 bits store codes down to -128 in our int8 format, which the panels' products take."""
    if kind == "awq":
        path = make_awq(base_dir, tmp_path / "awq", 64)
    else:
        path = make_gptq(base_dir, tmp_path / "gptq", 8, 32, True, False)
    quant = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    assert any(isinstance(m, QuantLinear) for m in _model(quant).modules())
    oracle = LLM(str(path) + "-dequant", dtype="float32", kv_cache_memory=0.02)
    diff = torch.cat([(a - b).abs() for a, b in zip(_run(quant)[1], _run(oracle)[1])])
    assert diff.mean() < (0.2 if kind == "awq" else 0.05) and diff.max() < 2.0, diff


def test_flag_must_match_the_checkpoint(base_dir, tmp_path) -> None:
    path = make_awq(base_dir, tmp_path / "awq", 32)
    LLM(str(path), dtype="float32", kv_cache_memory=0.02, quantization="awq")
    with pytest.raises(ValueError, match="--quantization gptq does not match the checkpoint, which is AWQ"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.02, quantization="gptq")
    with pytest.raises(ValueError, match="--quantization awq needs a AWQ checkpoint"):
        LLM(str(base_dir), dtype="float32", kv_cache_memory=0.02, quantization="awq")


def test_old_auto_gptq_quantize_config_json(base_dir, tmp_path) -> None:
    """Older auto-gptq folders keep the settings in quantize_config.json, not config.json."""
    path = make_gptq(base_dir, tmp_path / "gptq", 4, 64, False, True)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    del qc["quant_method"], qc["checkpoint_format"]
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "quantize_config.json").write_text(json.dumps(qc))
    _compare(path, native=False)


def _edit(path: Path, qconfig: dict | None = None, drop: str | None = None, reshape: str | None = None) -> Path:
    if qconfig is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(qconfig)
        (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "edit,message",
    [
        (dict(qconfig={"bits": 3}), "GPTQ checkpoint with bits=3 is not supported; supported: awq"),
        (dict(qconfig={"quant_method": "bitsandbytes"}), "quant_method 'bitsandbytes' is not supported"),
        (dict(qconfig={"checkpoint_format": "marlin"}), "checkpoint_format 'marlin' is not supported"),
        (dict(drop="model.layers.0.self_attn.q_proj.scales"), r"q_proj.scales is missing"),
        (dict(drop="model.layers.1.mlp.down_proj.qzeros"), r"down_proj.qzeros is missing"),
        (
            dict(reshape="model.layers.0.mlp.up_proj.scales"),
            r"up_proj.scales has shape \(3, 256\), expected \(4, 256\)",
        ),
        (dict(reshape="model.layers.0.mlp.up_proj.g_idx"), r"up_proj.g_idx: expected 128 group indices"),
    ],
)
def test_bad_gptq_checkpoints_refused_at_load(base_dir, tmp_path, edit, message) -> None:
    path = _edit(make_gptq(base_dir, tmp_path / "gptq", 4, 32, False, False), **edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), dtype="float32", kv_cache_memory=0.02)


def test_bad_awq_checkpoints_refused_at_load(base_dir, tmp_path) -> None:
    path = _edit(make_awq(base_dir, tmp_path / "awq", 32), qconfig={"version": "gemv"})
    with pytest.raises(ValueError, match="AWQ checkpoint version 'gemv' is not supported"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    path = _edit(path, qconfig={"version": "gemm"}, reshape="model.layers.0.self_attn.o_proj.qzeros")
    with pytest.raises(ValueError, match=r"o_proj.qzeros has shape \(3, 16\), expected \(4, 16\)"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.02)
