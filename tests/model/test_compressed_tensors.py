"""Pre-quantized checkpoints (model/compressed_tensors.py): compressed-tensors W8A8 INT8, FP8
(per-channel and per-tensor), W4A16 / W8A16 pack-quantized, quant_method fp8, --quantization fp8.

The checkpoints are written here from a tiny random Llama by compressed-tensors itself
(apply_quantization_config, min-max scales by its calculate_qparams, ModelCompressor's compressors:
what llm-compressor's data-free oneshot schemes save). The oracle: a float checkpoint of the same
weights fake-quantized by compressed-tensors (its fake_quantize), loaded as plain float32: greedy
tokens equal and logprobs close (weight-only formats: the same float weights, so equal up to
float32 rounding; W8A8: our per-token int8 activations add at most half a step per activation)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from safetensors.torch import load_file, save_file
from test_w8a8 import _FakeQuantLinear, _greedy, _logprob_diffs
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils.quantization_config import CompressedTensorsConfig

from tokenmill import LLM, SamplingParams
from tokenmill.model import compressed_tensors as ct
from tokenmill.model.layers.bind import bind_kernels
from tokenmill.model.layers.quantization import QuantLinear, a8_linear
from tokenmill.model.layers.w8a8 import W8A8Linear
from tokenmill.model.loader import _iter_safetensors

ctq = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

N_TOKENS = 12


def _scheme(name: str, group_size: int | None = None, actorder: bool = False, symmetric: bool = True) -> dict:
    s = ctq.preset_name_to_scheme(name, ["Linear"]).model_dump()
    if group_size is not None:
        s["weights"]["group_size"] = group_size
    if not symmetric:
        s["weights"]["symmetric"] = False
    return s


def _write(base: str, out: Path, scheme: dict) -> tuple[Path, Path]:
    """(the compressed-tensors checkpoint, the float oracle's checkpoint) of base quantized by scheme."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    qc = ctq.QuantizationConfig.model_validate(
        {"config_groups": {"group_0": {"targets": ["Linear"], **scheme}}, "ignore": ["lm_head"]}
    )
    ctq.apply_quantization_config(model, qc)
    fake = {}
    for name, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None or s.weights is None:
            continue
        a, w = s.weights, m.weight.data
        if a.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif a.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:
            g = w.unflatten(-1, (-1, a.group_size))
            lo, hi = g.amin(-1), g.amax(-1)
        scale, zp = calculate_qparams(lo, hi, a)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data = zp.to(m.weight_zero_point.dtype).reshape(m.weight_zero_point.shape)
        zp_arg = getattr(m, "weight_zero_point", None)
        fake[name + ".weight"] = fake_quantize(w, m.weight_scale.data, zp_arg, a).float().clone()
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    qdir = out / "ct"
    model.save_pretrained(qdir)
    comp.update_config(str(qdir))
    for f in Path(base).iterdir():  # the tokenizer
        if "token" in f.name and not (qdir / f.name).exists():
            shutil.copy(f, qdir / f.name)
    odir = out / "oracle"
    shutil.copytree(base, odir)
    (st,) = odir.glob("*.safetensors")
    dense = load_file(st)
    for k, v in fake.items():
        assert k in dense
        dense[k] = v.to(dense[k].dtype)
    save_file(dense, st, metadata={"format": "pt"})
    return qdir, odir


def _run(path: Path, **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.02, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_TOKENS, temperature=0, logprobs=0), use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [
        torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
        for o in outs
    ]
    return toks, lps, llm


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("ct_base")))


@pytest.mark.parametrize(
    "scheme,tol",
    [
        (_scheme("FP8_DYNAMIC"), 1e-4),  # channel fp8 weights, dynamic per-token fp8 activations
        (_scheme("FP8"), 1e-4),  # tensor fp8 weights, static activation scales
        (_scheme("W4A16", group_size=16, symmetric=False), 1e-4),  # zero points
        (_scheme("W8A16", group_size=32), 1e-4),  # pack-quantized int8 groups
    ],
    ids=["fp8-dynamic", "fp8-tensor", "w4a16-g16-asym", "w8a16"],
)
def test_weight_formats_match_the_dequantized_float_model(base, tmp_path, scheme, tol) -> None:
    qdir, odir = _write(base, tmp_path, scheme)
    toks, lps, _ = _run(qdir)
    otoks, olps, _ = _run(odir)
    assert toks == otoks
    for a, b in zip(lps, olps, strict=True):
        assert (a - b).abs().max() <= tol


def _transformers(qdir: Path):
    """transformers' compressed-tensors loader, decompressing on the CPU (run_compressed=False)."""
    cfg = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32, quantization_config=cfg).eval()


@pytest.mark.parametrize(
    "scheme",
    [_scheme("FP8_DYNAMIC"), _scheme("W4A16", group_size=32), _scheme("W4A16", group_size=16, symmetric=False)],
    ids=["fp8-dynamic", "w4a16-g32", "w4a16-g16-asym"],
)
def test_dequantized_weights_equal_transformers(base, tmp_path, scheme) -> None:
    """Our dequantization of every stored weight equals transformers' + compressed-tensors' decompression
    exactly; for the weight-only scheme the greedy tokens of the two models are equal too."""
    qdir, _ = _write(base, tmp_path, scheme)
    hf = _transformers(qdir)
    want = hf.state_dict()
    rows: dict[str, torch.Tensor] = {}
    got = dict(ct.dequantizing(_iter_safetensors(str(qdir)), ct.parse(ct.read_quantization_config(str(qdir))), rows))
    quantized = [k for k in got if ".layers." in k and k.endswith("proj.weight")]
    assert len(quantized) == 7 * 2 and not rows
    for k in quantized:
        assert torch.equal(got[k].float(), want[k].float()), k
    if (scheme["weights"]["group_size"] or 32) % 32:  # dense (not our int4 groups), activations as they are
        toks, _, _ = _run(qdir)
        tok = AutoTokenizer.from_pretrained(qdir)
        for prompt, ours in zip(PROMPTS, toks, strict=True):
            ids = tok(prompt, return_tensors="pt").input_ids
            out = hf.generate(ids, max_new_tokens=N_TOKENS, do_sample=False)
            assert out[0, ids.shape[1] :].tolist() == ours, prompt


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False)])
def test_int4_groups_of_32_run_on_the_int4_kernels(base, tmp_path, group_size, symmetric) -> None:
    """W4A16 in groups of 32k (no act-order) maps onto QuantLinear (our int4 groups of 32: c = q + 8,
    d = s, m = -(z + 8) s, d and m in float16): the dequantized weights within float16 rounding of
    the checkpoint's; each layer computes the int4 kernel's function (a8_linear: int8 activations
    per group of 32) of the codes unpacked here from the file, as tests/model/test_quantization.py
    checks the kernel; and the model stays near the float model of the checkpoint's weights."""
    qdir, odir = _write(base, tmp_path, _scheme("W4A16", group_size=group_size, symmetric=symmetric))
    toks, lps, llm = _run(qdir)
    model = llm.engine.core.runner.model
    dense = load_file(next(odir.glob("*.safetensors")))
    stored = load_file(next(qdir.glob("*.safetensors")))
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear)
    assert not isinstance(model.lm_head, QuantLinear)  # ignored
    (group,) = ct.parse(ct.read_quantization_config(str(qdir))).groups
    for sub, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.down_proj", ("down_proj",))):
        layer = model.layers[1].get_submodule(sub)
        names = [f"model.layers.1.{sub.split('.')[0]}.{p}" for p in parts]
        want = torch.cat([dense[n + ".weight"].float() for n in names])
        amax = want.unflatten(1, (-1, 32)).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(want.shape)
        assert ((layer.dequantized() - want).abs() <= amax * 2**-9 + 1e-7).all()  # |c d| + |m| <= 3.1 amax
        groups = [
            ct.int4_groups(n, {k[len(n) + 1 :]: v for k, v in stored.items() if k.startswith(n + ".")}, group)
            for n in names
        ]
        codes = torch.cat([c for c, _ in groups])
        scales = torch.cat([dm for _, dm in groups]).half()
        c = codes.view(codes.shape[0], -1, 32)
        qweight = (c[..., :16] | (c[..., 16:] << 4)).reshape(codes.shape[0], -1)
        for rows in (1, 5):
            x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows))
            torch.testing.assert_close(layer(x).double(), a8_linear(x, qweight, scales, 4), atol=1e-3, rtol=1e-5)
    first = torch.stack([a[0] - b[0] for a, b in zip(lps, _run(odir)[1], strict=True)]).abs()
    assert first.max() < 0.25


def test_w8a8_int8_loads_the_checkpoint_integers(base, tmp_path) -> None:
    qdir, odir = _write(base, tmp_path, _scheme("W8A8"))
    toks, lps, llm = _run(qdir)
    model = llm.engine.core.runner.model
    stored = load_file(next(qdir.glob("*.safetensors")))
    attn = model.layers[0].self_attn.qkv_proj
    assert isinstance(attn, W8A8Linear) and isinstance(model.layers[1].mlp.down_proj, W8A8Linear)
    assert not isinstance(model.lm_head, W8A8Linear)  # ignore: ["lm_head"]
    p = "model.layers.0.self_attn."
    q = torch.cat([stored[p + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj")])
    s = torch.cat([stored[p + n + ".weight_scale"].reshape(-1) for n in ("q_proj", "k_proj", "v_proj")])
    # as stored, but -128 (compressed-tensors' range) runs as -127 (our kernel's): one step, rare
    assert torch.equal(attn.weight_int8(), q.clamp(min=-127)) and torch.equal(attn.w_scale, s)
    assert (q == -128).sum() <= 2 * q.shape[0]
    # the oracle (test_w8a8's): every W8A8Linear replaced by float64 fake quantization of the same
    # int8 weights and of the activations (per token, 8 bits): tokens equal, logprobs close (the
    # bound: what flipping near-tie activation codes does, as there)
    want = _greedy(_fake_quantized_llm(qdir))
    tie_effect = _logprob_diffs(_greedy(_fake_quantized_llm(qdir, other_at_ties=True)), want).max().item()
    got = _greedy(llm)
    assert [a.token_ids for a in got] == [b.token_ids for b in want]
    diffs = _logprob_diffs(got, want)
    bound = 1e-4 + 2 * tie_effect
    assert bound < 0.25  # a code flip moves a logprob by a fraction of a step, not more
    assert diffs.median() < 1e-4 and diffs.max() < bound, (diffs.median(), diffs.max(), bound)
    # and the W8A8 model stays near the float model of the checkpoint's weights (first token)
    first = torch.stack([a[0] - b[0] for a, b in zip(lps, _run(odir)[1], strict=True)]).abs()
    assert first.max() < 0.1


def _fake_quantized_llm(path: Path, other_at_ties: bool = False) -> LLM:
    oracle = LLM(str(path), dtype="float32", kv_cache_memory=0.02)
    model = oracle.engine.core.runner.model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, W8A8Linear):
                setattr(parent, name, _FakeQuantLinear(child, other_at_ties))
    bind_kernels(model, "cpu", torch.float32)  # modules swapped after load: bound again
    return oracle


def test_quant_method_fp8_checkpoint(base, tmp_path) -> None:
    """transformers / vLLM FP8 style: quant_method fp8, e4m3 weights with weight_scale_inv, also per [block]."""
    for block in (None, [32, 32]):
        out = tmp_path / f"fp8-{block[0] if block else 0}"
        shutil.copytree(base, out)
        (st,) = out.glob("*.safetensors")
        dense = load_file(st)
        oracle = dict(dense)
        for k in list(dense):
            if ".layers." in k and k.endswith("proj.weight"):
                w = dense[k].float()
                if block is None:
                    s = w.abs().amax().clamp_min(1e-12) / ct.FP8_MAX
                    q = (w / s).to(torch.float8_e4m3fn)
                    oracle[k] = q.float() * s
                    dense[k.replace(".weight", ".weight_scale_inv")] = s.reshape(1)
                else:
                    blocks = w.unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # [ro, 32, ci, 32]
                    s = blocks.abs().amax((1, 3)).clamp_min(1e-12) / ct.FP8_MAX  # [ro, ci]
                    full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
                    q = (w / full).to(torch.float8_e4m3fn)
                    oracle[k] = q.float() * full
                    dense[k.replace(".weight", ".weight_scale_inv")] = s
                dense[k] = q
        save_file(dense, st, metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
        if block:
            cfg["quantization_config"]["weight_block_size"] = block
        (out / "config.json").write_text(json.dumps(cfg))
        odir = tmp_path / f"oracle-{block[0] if block else 0}"
        shutil.copytree(base, odir)
        save_file(oracle, next(odir.glob("*.safetensors")), metadata={"format": "pt"})
        toks, lps, _ = _run(out)
        otoks, olps, _ = _run(odir)
        assert toks == otoks
        assert max((a - b).abs().max() for a, b in zip(lps, olps, strict=True)) <= 1e-4


def test_quantization_fp8_at_load_runs_e4m3_weights(base, tmp_path) -> None:
    """--quantization fp8 on a float checkpoint: the model equals a float model whose decoder linears
    hold e4m3 values times per-output-channel scales (amax / 448), computed here by torch's cast;
    the embeddings and lm_head stay as they are."""
    odir = tmp_path / "oracle"
    shutil.copytree(base, odir)
    (st,) = odir.glob("*.safetensors")
    dense = load_file(st)
    n = 0
    for k, w in dense.items():
        if ".layers." in k and k.endswith("proj.weight"):
            scale = w.float().abs().amax(1, keepdim=True) / 448.0
            dense[k] = ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)
            assert not torch.equal(dense[k], w)
            n += 1
    assert n == 14
    save_file(dense, st, metadata={"format": "pt"})
    toks, lps, _ = _run(Path(base), quantization="fp8")
    otoks, olps, _ = _run(odir)
    ftoks, flps, _ = _run(Path(base))
    assert toks == otoks
    assert max((a - b).abs().max() for a, b in zip(lps, olps, strict=True)) <= 1e-4
    assert max((a - b).abs().max() for a, b in zip(lps, flps, strict=True)) > 1e-4  # it did round


def _config(qc: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"], **qc}


@pytest.mark.parametrize(
    "qc,message",
    [
        (
            _config({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 3, "type": "int"}}}}),
            "3 bits",
        ),
        (
            _config({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}}),
            "float",
        ),
        (_config({"format": "marlin-24", "config_groups": {"g": {"weights": {"num_bits": 4}}}}), "marlin-24"),
        (_config({"config_groups": {}}), "config_groups"),
        (
            _config(
                {
                    "config_groups": {
                        "g": {
                            "format": "int-quantized",
                            "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                            "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": True},
                        }
                    }
                }
            ),
            "per-token",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(qc, message) -> None:
    with pytest.raises(ValueError, match=message):
        ct.parse(qc)


def test_bad_checkpoints_get_a_clear_error(base, tmp_path) -> None:
    qdir, _ = _write(base, tmp_path, _scheme("W8A8"))
    st = next(qdir.glob("*.safetensors"))
    tensors = load_file(st)
    del tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_proj.*without weight_scale"):
        LLM(str(qdir), dtype="float32", kv_cache_memory=0.02)
    with pytest.raises(ValueError, match="pre-quantized compressed-tensors"):
        LLM(str(qdir), dtype="float32", kv_cache_memory=0.02, quantization="int4")
    with pytest.raises(ValueError, match="no compressed-tensors"):
        LLM(base, dtype="float32", kv_cache_memory=0.02, quantization="compressed-tensors")


def test_pack_quantized_act_order_and_zero_points_dequantize_per_the_layout() -> None:
    """weight_g_idx (act-order: column j takes group g_idx[j]'s scale and zero point; older
    llm-compressor GPTQ checkpoints) and zero points packed along the output dimension, the
    codes packed by compressed-tensors' own pack_to_int32: w[n, j] = (q[n, j] - z[n, g]) * s[n, g]."""
    torch.manual_seed(0)
    rows, cols, gs = 24, 64, 16
    q = torch.randint(-8, 8, (rows, cols), dtype=torch.int8)
    z = torch.randint(-8, 8, (rows, cols // gs), dtype=torch.int8)
    s = torch.rand(rows, cols // gs) + 0.1
    g_idx = torch.randperm(cols) // gs
    want = torch.stack([(q[:, j].float() - z[:, g_idx[j]].float()) * s[:, g_idx[j]] for j in range(cols)], 1)
    tensors = {
        "weight_packed": pack_to_int32(q, 4),
        "weight_shape": torch.tensor([rows, cols]),
        "weight_scale": s,
        "weight_zero_point": pack_to_int32(z, 4, packed_dim=0),
        "weight_g_idx": g_idx.to(torch.int32),
    }
    qc = _config({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}})
    qc["config_groups"]["g"]["weights"].update(strategy="group", group_size=gs, symmetric=False)
    (group,) = ct.parse(qc).groups
    assert torch.equal(ct.dequantize("x", tensors, group, None), want)
    tensors["weight_scale"] = s[:, :3]  # scales that do not fit the groups
    with pytest.raises(ValueError, match="does not fit"):
        ct.dequantize("x", tensors, group, None)
