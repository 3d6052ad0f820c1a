"""Build tiny, seeded, randomly initialised checkpoints as Hugging Face folders.

Each folder has config.json, model.safetensors and a byte-level BPE tokenizer trained here
with the `tokenizers` library (no hub access), plus a ChatML chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests every step.",
    "Les élèves étudient à l'école. Über café naïve façade — 東京 北京 😀 🚀",
    "def add(a, b):\n    return a + b\n",
    "1234567890 + - * / = ( ) [ ] { } < > ? ! , . ; :",
] * 20


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": None,
                "pad_token": "<|endoftext|>",
                "model_max_length": 512,
                "chat_template": CHATML,
                "add_bos_token": False,
            }
        )
    )
    return tok.get_vocab_size()


MOE = {  # arch -> (transformers class prefix, config beyond `common`)
    "mixtral": (
        "Mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            num_hidden_layers=4,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ),
}


def _tokenizer_ids(out: Path) -> tuple[int, int, int, int]:
    """Builds the tiny tokenizer in `out`; (vocab size, bos id, eos id, pad id)."""
    from tokenizers import Tokenizer

    vocab = build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return vocab, *(tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """arch: 'llama' (GQA, llama3 rope scaling, untied), 'qwen2' (qkv bias, tied embeddings) or
    'qwen3' (q/k norms, head_dim 32 != hidden / heads, tied embeddings) or 'phi3' (fused qkv and
    gate_up; pass partial_rotary_factor / rope_scaling for Phi-4-mini-like rope), 'mistral'
    (untied; give it a sliding_window), or a mixture of experts with 4 experts, top 2: 'mixtral',
    'qwen2_moe' (shared expert, a dense layer by mlp_only_layers), 'qwen3_moe' (q/k norms,
    norm_topk_prob, dense layers by decoder_sparse_step)."""
    import torch
    import transformers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos, pad = _tokenizer_ids(out)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,  # spread logits so greedy choices are not near-ties
        bos_token_id=bos,
        eos_token_id=eos,
        rope_theta=10000.0,
    )
    if arch == "llama":
        common.update(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        common.update(overrides)
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        common.update(tie_word_embeddings=True)
        common.update(overrides)
        cfg, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "qwen3":
        common.update(tie_word_embeddings=True, head_dim=32)
        common.update(overrides)
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif arch == "phi3":
        common.update(tie_word_embeddings=False, pad_token_id=pad)
        common.update(overrides)
        cfg, cls = Phi3Config(**common), Phi3ForCausalLM
    elif arch == "mistral":
        common.update(tie_word_embeddings=False, head_dim=16)
        common.update(overrides)
        cfg, cls = MistralConfig(**common), MistralForCausalLM
    elif arch in MOE:
        name, extra = MOE[arch]
        common.update(extra)
        common.update(overrides)
        cfg, cls = getattr(transformers, name + "Config")(**common), getattr(transformers, name + "ForCausalLM")
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    if arch in ("qwen2", "qwen2_moe"):  # HF zero-inits biases; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if arch in ("qwen3", "qwen3_moe"):  # HF inits the q/k norms to ones; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_gemma(out: Path, version: int = 2, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma 2 or 3 (text) with 4 layers, sliding ones (window 8) among global ones, query
    pre-scaling other than head_dim, Gemma 2's soft-caps set low enough to bite, Gemma 3's rope
    bases apart (global: linear scaling), and random norm weights (transformers zero-inits them)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos, pad = _tokenizer_ids(out)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, query_pre_attn_scalar=24, sliding_window=8,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    )  # fmt: skip
    if version == 2:
        common.update(attn_logit_softcapping=2.0, final_logit_softcapping=4.0)
        common.update(overrides)
        cfg, cls = Gemma2Config(**common), Gemma2ForCausalLM
    elif version == 3:
        common.update(
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        )  # fmt: skip
        common.update(overrides)
        cfg, cls = Gemma3TextConfig(**common), Gemma3ForCausalLM
    else:
        raise ValueError(version)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out
