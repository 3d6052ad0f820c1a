"""TGI routes (/generate, /generate_stream, /info) with TGI's request and response shapes."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import PROMPTS, running_server

from tokenmill import SamplingParams


@pytest.fixture(scope="module")
def http(tiny_llama_dir):
    with running_server(tiny_llama_dir) as (server, _), httpx.Client(base_url=server.url, timeout=60) as h:
        yield h


def _offline(llm, prompt, n):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0]


def _events(raw: str) -> list[dict]:
    assert raw.endswith("\n\n")
    return [json.loads(e[len("data:") :]) for e in raw[:-2].split("\n\n")]


def test_generate_greedy_equals_offline(http, tiny_llama_llm):
    want = _offline(tiny_llama_llm, PROMPTS[0], 10)
    r = http.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 10}})
    assert r.status_code == 200
    body = r.json()
    assert body == {"generated_text": want.text}  # no details unless asked
    r = http.post(
        "/generate",
        json={
            "inputs": PROMPTS[0],
            "parameters": {"max_new_tokens": 10, "details": True, "return_full_text": True, "top_n_tokens": 2},
        },
    )
    body = r.json()
    assert body["generated_text"] == PROMPTS[0] + want.text
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 10 and d["seed"] is None
    assert [t["id"] for t in d["tokens"]] == want.token_ids
    for t, top in zip(d["tokens"], d["top_tokens"]):
        assert set(t) == {"id", "text", "logprob", "special"} and t["logprob"] <= 0
        assert len(top) == 2 and top[0]["id"] == t["id"]  # greedy: the chosen token is the top one


def test_generate_stop_sequence_and_sampling(http, tiny_llama_llm):
    full = _offline(tiny_llama_llm, PROMPTS[1], 24).text
    stop = full[6:9]
    r = http.post(
        "/generate", json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 24, "stop": [stop], "details": True}}
    ).json()
    assert r["generated_text"] == full[: full.find(stop) + len(stop)]  # TGI keeps the stop sequence
    assert r["details"]["finish_reason"] == "stop_sequence"
    params = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.9, "seed": 3, "details": True}
    a, b = (http.post("/generate", json={"inputs": "Hello", "parameters": params}).json() for _ in range(2))
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 3


def test_generate_stream(http, tiny_llama_llm):
    want = _offline(tiny_llama_llm, PROMPTS[2], 8)
    with http.stream(
        "POST", "/generate_stream", json={"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 8, "details": True}}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.read().decode())
    assert [e["index"] for e in events] == list(range(1, 9))
    assert [e["token"]["id"] for e in events] == want.token_ids
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == want.text == "".join(e["token"]["text"] for e in events)
    n_input = len(tiny_llama_llm.get_tokenizer().encode(PROMPTS[2]))
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 8, "seed": None, "input_length": n_input}


@pytest.mark.parametrize(
    "params,words",
    [
        ({"temperature": 0}, "`temperature` must be strictly positive"),
        ({"top_k": 0}, "`top_k` must be strictly positive"),
        ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
        ({"max_new_tokens": 600}, "`inputs` tokens + `max_new_tokens` must be <= 512"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "up to 4 stop sequences"),
        ({"top_n_tokens": 9}, "`top_n_tokens` must be >= 0 and <= 5"),
        ({"best_of": 2}, "`best_of`"),
        ({"temperature": "hot"}, "temperature"),
    ],
    ids=[
        "temperature",
        "top_k",
        "max_new_tokens",
        "over_context",
        "stop_count",
        "top_n_tokens",
        "best_of",
        "wrong_type",
    ],
)
def test_tgi_validation_errors(http, params, words):
    for path in ("/generate", "/generate_stream"):
        r = http.post(path, json={"inputs": "Hello", "parameters": params})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error_type"] == "validation" and words in body["error"]


def test_tgi_empty_inputs_and_malformed_json(http):
    r = http.post("/generate", json={"inputs": ""})
    assert r.status_code == 422 and "`inputs` cannot be empty" in r.json()["error"]
    for path in ("/generate", "/generate_stream"):  # 422 as TGI's schema says, malformed JSON included
        r = http.post(path, content=b"{nope", headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error_type"] == "validation" and "Malformed JSON" in r.json()["error"]


def test_info(http):
    info = http.get("/info").json()
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511 and info["model_id"]
