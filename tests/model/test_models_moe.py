"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers: tiny random
checkpoints with 4 experts, top 2 (tests/tiny_models.py), greedy in float32 with chunked prefill
and preemption, token for token, logprobs within 1e-3; the same through GGUF files written the way
llama.cpp writes them (tests/gguf_writer.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from hf_oracle import hf_greedy, load_hf, matching_prefix
from tiny_models import build_tiny_model

from tokenmill import LLM, SamplingParams

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model folder, prompt ids, transformers' greedy result per prompt), built once per family."""
    from tokenizers import Tokenizer

    path = str(build_tiny_model(tmp_path_factory.mktemp(request.param), request.param))
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    ids = [tok.encode(p).ids for p in PROMPTS]
    return path, ids, [hf_greedy(path, p, MAX_TOKENS) for p in ids]


def check_against_hf(llm: LLM, ids, expected) -> None:
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    for out, exp in zip(outs, expected):
        n = matching_prefix(out.outputs[0].token_ids, exp)
        got = [next(iter(d.values())).logprob for d in out.outputs[0].logprobs[: n + 1]]
        assert max(abs(a - b) for a, b in zip(got, exp[1])) < 1e-3
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def tight_llm(model: str) -> LLM:
    """8-token chunks of prompts and a KV pool far smaller than the batch needs (preemptions)."""
    return LLM(model, dtype="float32", num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=8)


def test_greedy_matches_transformers(family):
    path, ids, expected = family
    assert max(map(len, ids)) > 8  # prompts run in chunks
    llm = tight_llm(path)
    check_against_hf(llm, ids, expected)
    assert llm.engine.core.scheduler.num_preemptions > 0
    # Each prompt alone: the same tokens (the experts' rows do not depend on their batch).
    for p, exp in zip(ids[:3], expected):
        matching_prefix(
            llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids, exp
        )


def test_gguf_matches_transformers(family, tmp_path, monkeypatch):
    """llama.cpp's layout (stacked experts, Mixtral as "llama" with experts, Qwen2-MoE's shared
    expert tensors) converted back to the Hub's names, then run as above."""
    from gguf_writer import write_gguf_from_hf
    from transformers import AutoConfig

    path, ids, expected = family
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_gguf_from_hf(path, tmp_path / "moe.gguf")
    llm = tight_llm(str(gguf_file))
    want, got = AutoConfig.from_pretrained(path), AutoConfig.from_pretrained(llm.engine.config.model.path)
    assert got.architectures == want.architectures
    for key in (
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
    ):
        assert getattr(got, key, None) == getattr(want, key, None), key
    if hasattr(want, "decoder_sparse_step"):  # the same layers sparse (GGUF lists the dense ones in mlp_only_layers)
        from tokenmill.model.models.qwen2_moe import is_sparse

        layers = range(want.num_hidden_layers)
        assert [is_sparse(got, i) for i in layers] == [is_sparse(want, i) for i in layers]
    check_against_hf(llm, ids, expected)


def test_stacked_expert_names_load_alike(family):
    """transformers >= 5 holds experts stacked (experts.gate_up_proj [E, 2I, H]); its state dict
    loads into the same parameters as the checkpoint's per-expert tensors."""
    from tokenmill.model.loader import load_hf_config, load_model

    path = family[0]
    cfg = load_hf_config(path)
    ours = load_model(path, cfg, torch.float32, 512)
    stacked = load_model(path, cfg, torch.float32, 512, load_format="dummy")
    state = load_hf(path).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    stacked.load_weights(state.items())
    for (name, a), (_, b) in zip(ours.named_parameters(), stacked.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_expert_is_refused(family):
    from tokenmill.model.loader import _iter_safetensors, load_hf_config, load_model

    path = family[0]
    model = load_model(path, load_hf_config(path), torch.float32, 512, load_format="dummy")
    weights = [(n, w) for n, w in _iter_safetensors(path) if ".experts.3." not in n]
    with pytest.raises(ValueError, match="missing weights"):
        model.load_weights(weights)
