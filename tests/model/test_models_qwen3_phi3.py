"""Qwen3 and Phi-3 against transformers: tiny random checkpoints (HF folders and GGUF files written
here), greedy tokens token for token and logprobs within 1e-3 in float32, under chunked prefill
(8-token chunks) and preemption (a KV pool of a few 4-token blocks). And GGUF k-quants."""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from conftest import PROMPTS
from gguf_writer import _gguf_name, write_gguf_from_hf
from hf_oracle import check_against_hf, hf_greedy, load_hf, matching_prefix
from safetensors.numpy import load_file
from tiny_models import CORPUS, build_tiny_model

from tokenmill import LLM, SamplingParams
from tokenmill.model.gguf_loader import gguf_to_hf_folder

MAX_TOKENS = 16
TIGHT = dict(dtype="float32", num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=8)
# Over 32 tokens (Phi-3 longrope's pretrained context below): the long factors
LONG_PROMPTS = [" ".join(CORPUS[:4]), " ".join(CORPUS[2:5])]
LONGROPE = dict(
    max_position_embeddings=256,
    original_max_position_embeddings=32,
    partial_rotary_factor=0.5,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.5, 6.0, 15.0]},
)  # head_dim 16, rotary 8: 4 frequencies


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3"))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-phi3"), "phi3"))


@pytest.fixture(scope="module")
def phi3_longrope_dir(tmp_path_factory) -> str:
    """Phi-4-mini-like rope: half of each head turns, LongRoPE factors."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-phi3-longrope"), "phi3", **LONGROPE))


def test_qwen3_matches_hf(qwen3_dir: str) -> None:
    check_against_hf(LLM(qwen3_dir, **TIGHT), qwen3_dir, PROMPTS[:4])


def test_qwen3_tensor_parallel_matches_hf(qwen3_dir: str) -> None:
    """TP=2: each rank one kv head and two query heads, the q/k norms replicated."""
    llm = LLM(qwen3_dir, tensor_parallel_size=2, device="cpu", **TIGHT)  # gloo ranks
    try:
        check_against_hf(llm, qwen3_dir, PROMPTS[:3])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("which,targets", [("qwen3", None), ("phi3", ["qkv_proj", "o_proj", "gate_up_proj"])])
def test_lora_matches_peft(which: str, targets: list[str] | None, request: pytest.FixtureRequest, tmp_path) -> None:
    """A PEFT adapter: Qwen3's on every projection, Phi-3's on its fused modules (whole)."""
    pytest.importorskip("peft")
    from hf_oracle import greedy
    from lora_adapters import make_adapter, peft_model

    from tokenmill import LoRARequest

    hf_dir = request.getfixturevalue(f"{which}_dir")
    adapter = make_adapter(hf_dir, tmp_path / "lora", rank=8, targets=targets, seed=1)
    llm = LLM(hf_dir, enable_lora=True, max_lora_rank=8, **TIGHT)
    oracle, tok = peft_model(hf_dir, adapter), llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS[:3], params, lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    for prompt, out in zip(PROMPTS[:3], outs):
        ref = greedy(oracle, tok.encode(prompt), MAX_TOKENS)
        n = matching_prefix(out.outputs[0].token_ids, ref)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[: n + 1]]
        assert max(abs(a - b) for a, b in zip(got, ref[1])) < 1e-3
        assert out.outputs[0].token_ids != hf_greedy(hf_dir, tok.encode(prompt), MAX_TOKENS)[0]  # it matters


def test_phi3_matches_hf(phi3_dir: str) -> None:
    check_against_hf(LLM(phi3_dir, **TIGHT), phi3_dir, PROMPTS[:4])


def test_phi3_tensor_parallel_matches_hf(phi3_longrope_dir: str) -> None:
    """TP=2: each rank's heads and MLP rows cut out of the checkpoint's fused qkv_proj / gate_up_proj."""
    llm = LLM(phi3_longrope_dir, tensor_parallel_size=2, max_model_len=32, device="cpu", **TIGHT)
    try:
        check_against_hf(llm, phi3_longrope_dir, PROMPTS[:3])
    finally:
        llm.shutdown()


def test_phi3_longrope_partial_rotary_matches_hf(phi3_longrope_dir: str) -> None:
    # A context within the pretrained 32 tokens runs the short factors, a longer one the long
    # factors, as transformers does for sequences that short / that long.
    check_against_hf(LLM(phi3_longrope_dir, max_model_len=32, **TIGHT), phi3_longrope_dir, PROMPTS[:4])
    long = LLM(phi3_longrope_dir, **{**TIGHT, "num_gpu_blocks_override": 24})
    assert len(long.get_tokenizer().encode(LONG_PROMPTS[0])) > 32
    check_against_hf(long, phi3_longrope_dir, LONG_PROMPTS)


def test_phi3_sliding_window_shorter_than_the_prompts_matches_hf(tmp_path) -> None:
    """Every layer attends its last 8 keys (transformers' Phi-3 masks the rest), prompts longer than that."""
    hf_dir = str(build_tiny_model(tmp_path / "hf", "phi3", sliding_window=8))
    llm = LLM(hf_dir, **{**TIGHT, "num_gpu_blocks_override": 10})  # preempts though the window frees blocks
    prompts = [PROMPTS[5], CORPUS[4], CORPUS[6]]
    assert min(len(llm.get_tokenizer().encode(p)) for p in prompts) > 8
    assert [p[0] for p in llm.engine.core.runner.attn.params] == [8, 8]
    check_against_hf(llm, hf_dir, prompts)


@pytest.mark.parametrize("which", ["qwen3", "phi3_longrope"])
def test_gguf_matches_hf(which: str, request: pytest.FixtureRequest, tmp_path, monkeypatch) -> None:
    """llama.cpp's qwen3 / phi3 files: the converted folder is the original model (transformers
    reads both), and the engine on the .gguf file gives transformers' tokens."""
    hf_dir = request.getfixturevalue(f"{which}_dir")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf_from_hf(hf_dir, tmp_path / f"{which}.gguf"))
    ref, conv = load_hf(hf_dir), load_hf(gguf_to_hf_folder(path))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (7, 40):  # phi3_longrope: short, then long factors
            ids = torch.randint(0, ref.config.vocab_size, (1, n), generator=gen)
            torch.testing.assert_close(conv(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    if which == "qwen3":
        check_against_hf(LLM(path, **TIGHT), hf_dir, PROMPTS[:4])
    else:
        check_against_hf(LLM(path, **{**TIGHT, "num_gpu_blocks_override": 24}), hf_dir, LONG_PROMPTS)


# Every k-quant the gguf package dequantizes, placed as Q4_K_M-style files mix them.
K_MIX = {
    "token_embd": "Q4_K",
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q6_K",
    "attn_output": "Q3_K",
    "ffn_gate": "Q2_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}


# What llama.cpp's Q4_K_M puts where (roughly: it gives half the attn_v / ffn_down tensors Q6_K)
Q4_K_M = {
    "token_embd": "Q4_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}


@pytest.fixture(scope="module")
def qwen3_256_dir(tmp_path_factory) -> str:
    """k-quant blocks hold 256 values: rows of 256 and 512."""
    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("tiny-qwen3-256"), "qwen3", hidden_size=256, intermediate_size=512, head_dim=64
        )
    )


def test_kquant_gguf_loads_dequantized(qwen3_256_dir: str, tmp_path, monkeypatch, caplog) -> None:
    """k-quant tensors load as the gguf package dequantizes them, with a log line naming them;
    float32 engines rebuild them exactly from the kept rows of the bfloat16 cache, and generate
    transformers' tokens on the dequantized model."""
    path = str(write_gguf_from_hf(qwen3_256_dir, tmp_path / "k.gguf", qtype=K_MIX))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        exact = gguf_to_hf_folder(path)
    assert "GGUF tensors dequantized" in caplog.text
    for qtype in set(K_MIX.values()):
        assert f"{qtype}: " in caplog.text, qtype
    assert "blk.*.attn_v.weight, blk.*.ffn_down.weight (4 tensors)" in caplog.text  # Q6_K

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    converted = load_file(os.path.join(exact, "model.safetensors"))
    kinds = set()
    for name, w in converted.items():
        t = tensors[_gguf_name(name)]
        if t.tensor_type.name in K_MIX.values():
            kinds.add(t.tensor_type.name)
            np.testing.assert_array_equal(w, gguf.quants.dequantize(t.data, t.tensor_type))
    assert kinds == set(K_MIX.values())

    llm = LLM(path, **TIGHT)  # the engine's bfloat16 cache, loaded in float32
    check_against_hf(llm, exact, PROMPTS[:4])


def test_q4_k_runs_as_int4_groups_under_quantization_gguf(qwen3_256_dir: str, tmp_path, monkeypatch) -> None:
    """--quantization gguf keeps Q4_K tensors quantized (int4 groups of 32, the sub-block scale and
    min rounded to float16), next to the Q6_K ones running dense: the same greedy tokens."""
    from tokenmill.model.layers.quantization import QuantEmbedding, QuantLinear

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf_from_hf(qwen3_256_dir, tmp_path / "m.Q4_K_M.gguf", qtype=Q4_K_M))
    dense = LLM(path, dtype="float32", kv_cache_memory=0.02, device="cpu")  # QuantLinear: the CPU's kernels
    # float activations (the row kernel, not the int4 panels' int8 activations): the weights alone
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")
    quant = LLM(path, dtype="float32", kv_cache_memory=0.02, quantization="gguf", device="cpu")
    qmodel, dense_params = quant.engine.core.runner.model, dict(dense.engine.core.runner.model.named_parameters())
    layer = qmodel.layers[0]
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert isinstance(qmodel.embed_tokens, QuantEmbedding) and isinstance(qmodel.lm_head, QuantLinear)  # tied
    assert not isinstance(layer.self_attn.qkv_proj, QuantLinear)  # its v is Q6_K: the fused layer stays dense
    assert not isinstance(layer.mlp.down_proj, QuantLinear)
    kept = {n: m for n, m in qmodel.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
    assert len(kept) == 2 * 2 + 2
    for name, m in kept.items():
        want = dense_params.get(name + ".weight", dense_params["embed_tokens.weight"])
        got = m.dequantized()
        torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 2**-10)
        assert not torch.equal(got, want)  # float16 scales: close, not exact
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a, b = (llm.generate(PROMPTS[:4], params, use_tqdm=False) for llm in (dense, quant))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
