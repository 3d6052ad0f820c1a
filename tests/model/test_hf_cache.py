"""The config and tokenizer snapshots that keep transformers' config classes out of a warm start
(model/hf_cache.py): a later load reads every attribute as AutoConfig's config does, for every
family the engine serves; it does not import the config classes' module chain; an edited config or
an attribute a snapshot cannot hold is never served from a stale or partial snapshot; the tokenizer
is AutoTokenizer's class and encodes alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill import hf_cache

# One small config per family the engine serves (MODEL_REGISTRY), as the Hub writes them.
_FAMILIES = {
    "LlamaConfig": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "Qwen2Config": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "Qwen3Config": dict(head_dim=32),
    "Phi3Config": dict(partial_rotary_factor=0.75, sliding_window=32),
    "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2),
    "Gemma2Config": dict(sliding_window=16, final_logit_softcapping=30.0),
    "Gemma3TextConfig": dict(sliding_window=16, sliding_window_pattern=2),
    "BertConfig": dict(),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _save(cls_name: str, folder, **extra) -> str:
    import transformers

    cls = getattr(transformers, cls_name)
    small = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    if cls_name != "BertConfig":
        small["num_key_value_heads"] = 2
    config = cls(**small, **extra)
    config.architectures = [cls_name.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")]
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_a_snapshot_reads_back_as_autoconfigs_config(family, tmp_path):
    from transformers import AutoConfig

    path = _save(family, tmp_path / family, **_FAMILIES[family])
    first = hf_cache.load_config(path)
    assert type(first).__name__ == family  # transformers' own, the first time
    again = hf_cache.load_config(path)
    assert type(again) is not type(first), "no snapshot was kept"
    assert hf_cache._differences(AutoConfig.from_pretrained(path), again) == []
    assert again._name_or_path == path


def test_an_edited_config_is_loaded_afresh(tmp_path):
    path = _save("LlamaConfig", tmp_path / "m")
    hf_cache.load_config(path)
    assert type(hf_cache.load_config(path)).__name__ != "LlamaConfig"
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw["rms_norm_eps"] = 1e-3
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    fresh = hf_cache.load_config(path)
    assert type(fresh).__name__ == "LlamaConfig" and fresh.rms_norm_eps == 1e-3


def test_what_a_snapshot_cannot_hold_is_never_snapshotted(tmp_path, cache_dir, monkeypatch):
    import transformers

    path = _save("LlamaConfig", tmp_path / "m")
    real = transformers.AutoConfig.from_pretrained

    def with_an_object(*args, **kwargs):
        config = real(*args, **kwargs)
        config.helper = object()  # no JSON for it: a snapshot would lose it
        return config

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", with_an_object)
    hf_cache.load_config(path)
    assert not list(cache_dir.glob("hf/config-*.json"))
    assert type(hf_cache.load_config(path)).__name__ == "LlamaConfig"


def test_the_tokenizer_is_autotokenizers_class_and_encodes_alike(tiny_llama_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf_cache.load_tokenizer(tiny_llama_dir)
    tok = hf_cache.load_tokenizer(tiny_llama_dir)  # from the snapshot
    assert type(tok) is type(auto)
    for text in ("Hello world", " leading space", "東京 😀", "<s>special</s>"):
        assert tok.encode(text) == auto.encode(text)
    assert tok.all_special_tokens == auto.all_special_tokens and tok.chat_template == auto.chat_template


def test_a_warm_load_skips_the_config_classes_imports(tiny_llama_dir, cache_dir):
    """What the snapshot is for: transformers' config modules import torch.distributed.tensor,
    sympy and accelerate (~1.5 s on 2 cores); a second start loads config and tokenizer without them."""
    code = (
        "import sys; from tokenmill.model.loader import load_hf_config; from tokenmill.tokenizer import "
        f"load_tokenizer; load_hf_config({tiny_llama_dir!r}); load_tokenizer({tiny_llama_dir!r}); "
        "print(sorted(m for m in ('transformers.activations', 'torch.distributed.tensor') if m in sys.modules))"
    )
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(cache_dir)}
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    assert runs[0].stdout.split("\n")[-2] != "[]"  # the first start imports them (and keeps snapshots)
    assert runs[1].stdout.split("\n")[-2] == "[]", runs[1].stdout
