"""Kernels bound once, at load (model/layers/bind.py), and what the engine may do with a model
following from the modules it is built from (no per-family flags): tensor parallelism where a
sharding rule covers every module (model/sharding.py), LoRA where the adapters' linears are the
shared ones (lora/layers.py), the fused decode step where the C++ step implements every module
(worker/fused_decode.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from hf_oracle import hf_greedy, matching_prefix
from tiny_models import build_tiny_gemma, build_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.lora.layers import unadaptable_module
from tokenmill.model.layers.bind import bind_kernels
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.loader import load_hf_config, model_skeleton
from tokenmill.model.sharding import unshardable_module
from tokenmill.worker.fused_decode import unsupported_module

FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "phi3_partial", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3"]
TIGHT = dict(dtype="float32", num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=8)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Tiny checkpoints, built on first use."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            out = tmp_path_factory.mktemp(name)
            if name.startswith("gemma"):
                built[name] = str(build_tiny_gemma(out, int(name[-1])))
            elif name == "phi3_partial":  # Phi-4-mini's rope: half of each head turns
                built[name] = str(build_tiny_model(out, "phi3", partial_rotary_factor=0.5))
            else:
                built[name] = str(build_tiny_model(out, name))
        return built[name]

    return get


# ---- kernels bound at load ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,dtype,quantization",
    [
        ("llama", "bfloat16", None),
        ("llama", "float32", "int4"),
        ("qwen3", "bfloat16", None),
        ("mixtral", "float32", None),
        ("gemma2", "bfloat16", None),
    ],
)
def test_no_forward_asks_which_kernels_exist(family, dtype, quantization, family_dirs, monkeypatch):
    """After load, generating (prompt steps, decode steps, greedy and sampled) never calls
    cpu_kernels.ops_for / load / enabled: every module was bound its kernels at load, and they
    are the kernels (not the torch fallbacks) on this CPU. The tokens are those of the run before."""
    llm = LLM(
        family_dirs(family),
        dtype=dtype,
        quantization=quantization,
        kv_cache_memory=0.02,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    model = llm.engine.core.runner.model
    kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
    bound = [m for m in model.modules() if hasattr(m, "bind_kernels")]
    assert bound and all(m.ops is kernels for m in bound)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    before = [o.outputs[0].token_ids for p in params for o in llm.generate(PROMPTS[:3], p, use_tqdm=False)]

    def refuse(*args, **kwargs):
        raise AssertionError("a forward asked cpu_kernels which kernels exist")

    for name in ("ops_for", "load", "enabled"):
        monkeypatch.setattr(cpu_kernels, name, refuse)
    after = [o.outputs[0].token_ids for p in params for o in llm.generate(PROMPTS[:3], p, use_tqdm=False)]
    assert after == before


def test_an_unbound_module_runs_torch_and_a_bound_one_its_kernels():
    """bind_kernels decides once per module: the CPU kernels for float32 / bfloat16, nothing for a
    device without them (its torch forward); the results agree."""
    kernels = cpu_kernels.load() if cpu_kernels.enabled() else None
    if kernels is None:
        pytest.skip("no C++ kernels")
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    x = torch.randn(5, 64)
    assert norm.ops is None
    want = norm(x)
    assert bind_kernels(norm, "cpu", torch.float32) == 1 and norm.ops is kernels
    torch.testing.assert_close(norm(x), want, atol=1e-5, rtol=1e-5)
    bind_kernels(norm, "meta", torch.float32)
    assert norm.ops is None


# ---- capabilities from modules -------------------------------------------------------------------
# (tensor parallelism, LoRA, fused decode step): None where it applies, else the module it names.
CAPABILITIES = {
    "llama": (None, None, None),
    "qwen2": (None, None, None),
    "qwen3": (None, None, "layers.0.self_attn (QKNormAttention)"),
    "phi3": (None, None, None),  # whole heads turn: Llama's step runs it
    "phi3_partial": (None, None, "rope (RotaryEmbedding turning part of each head: the step turns whole heads)"),
    "mixtral": (None, "layers.0.mlp (SparseMoeBlock) has no gate_up_proj linear", "layers.0.mlp (SparseMoeBlock)"),
    "qwen2_moe": (None, "layers.0.mlp (SparseMoeBlock) has no gate_up_proj linear", "layers.0.mlp (SparseMoeBlock)"),
    "qwen3_moe": (
        None,
        "layers.1.mlp (SparseMoeBlock) has no gate_up_proj linear",
        "layers.0.self_attn (QKNormAttention)",
    ),
    "gemma2": (None, None, "the model (GemmaForCausalLM: its own forward)"),
    "gemma3": (None, None, "the model (GemmaForCausalLM: its own forward)"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_capabilities_follow_from_the_modules(family, family_dirs):
    model = model_skeleton(load_hf_config(family_dirs(family)))
    assert not hasattr(type(model), "SUPPORTS_LORA") and not hasattr(type(model), "SUPPORTS_TENSOR_PARALLEL")
    got = (unshardable_module(model), unadaptable_module(model), unsupported_module(model))
    assert got == CAPABILITIES[family]


def test_refusals_name_the_module(family_dirs):
    """LoRA on a mixture of experts (no shared gate/up linear in its MLP), refused before loading; a
    module without a sharding rule refuses tensor parallelism, named."""
    from tokenmill.model.sharding import check_shardable

    with pytest.raises(ValueError, match=r"--enable-lora .* MixtralForCausalLM .*layers\.0\.mlp \(SparseMoeBlock\)"):
        LLM(family_dirs("mixtral"), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    model = model_skeleton(load_hf_config(family_dirs("llama")))
    model.layers[1].mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"--tensor-parallel-size .* LlamaForCausalLM .*layers\.1\.mlp \(Sequential\)"):
        check_shardable(model, 2)
    check_shardable(model, 1)


def test_fused_step_follows_from_the_modules(family_dirs):
    """Phi-3 with whole heads turning is Llama's modules: the fused step runs it, its logits the
    op-by-op model's bit for bit; with partial rotary (Phi-4-mini) it declines."""
    from test_fused_decode import KW, _check_fused_equals_op_by_op

    _check_fused_equals_op_by_op(LLM(family_dirs("phi3"), **KW), 3)
    assert LLM(family_dirs("phi3_partial"), **KW).engine.core.runner.fast_decode is None


def _check_against_hf(llm: LLM, hf_dir: str, max_tokens: int = MAX_TOKENS, oracle=None) -> None:
    """Greedy tokens equal transformers' (or `oracle`'s: a PEFT model) up to a near-tie, logprobs within 1e-3."""
    from hf_oracle import greedy

    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False, **(oracle or {}).get("kw", {}))
    for p, out in zip(ids, outs):
        exp = greedy(oracle["model"], p, max_tokens) if oracle else hf_greedy(hf_dir, p, max_tokens)
        n = matching_prefix(list(out.outputs[0].token_ids), exp)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[: n + 1]]
        assert max(abs(a - b) for a, b in zip(got, exp[1])) < 1e-3


@pytest.mark.parametrize("version", [2, 3])
def test_gemma_tensor_parallel_matches_hf(version, family_dirs):
    """Gemma, once refused: its attention and MLP carry the shared blocks' sharding (whole heads,
    all-reduces), the tied LM head by vocab rows, the soft-cap after the gather."""
    path = family_dirs(f"gemma{version}")
    llm = LLM(path, tensor_parallel_size=2, device="cpu", **TIGHT)  # gloo ranks
    try:
        _check_against_hf(llm, path)
    finally:
        llm.shutdown()


def test_gemma_lora_matches_peft(family_dirs, tmp_path):
    """Gemma, once refused: a PEFT adapter on every projection, against PEFT's model."""
    pytest.importorskip("peft")
    from lora_adapters import make_adapter, peft_model

    from tokenmill import LoRARequest

    path = family_dirs("gemma3")
    adapter = make_adapter(path, tmp_path / "lora", rank=8, seed=1)
    llm = LLM(path, enable_lora=True, max_lora_rank=8, **TIGHT)
    oracle = {"model": peft_model(path, adapter), "kw": {"lora_request": LoRARequest("a", 1, adapter)}}
    _check_against_hf(llm, path, oracle=oracle)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    runs = [
        llm.generate(PROMPTS[:1], params, use_tqdm=False, **kw)[0].outputs[0]
        for kw in ({}, {"lora_request": LoRARequest("a", 1, adapter)})
    ]
    first = [next(iter(o.logprobs[0].values())).logprob for o in runs]
    assert abs(first[0] - first[1]) > 1e-3  # the adapter matters (and the base model still serves)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_tensor_parallel_matches_hf(family, family_dirs):
    """A mixture of experts split over two ranks (each a slice of every expert's intermediate
    rows, the partial sums all-reduced; Qwen2-MoE's shared expert and dense layer as MLPs) gives
    transformers' greedy tokens and logprobs, as one rank does."""
    path = family_dirs(family)
    llm = LLM(path, tensor_parallel_size=2, device="cpu", **{**TIGHT, "num_gpu_blocks_override": 24})
    try:
        _check_against_hf(llm, path)
    finally:
        llm.shutdown()
