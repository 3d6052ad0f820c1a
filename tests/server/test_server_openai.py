"""The OpenAI-compatible server, driven by the official `openai` client (sync and async,
streaming and not) and by httpx for raw SSE, against a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import PROMPTS, running_server
from prometheus_client.parser import text_string_to_metric_families

from tokenmill import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with running_server(tiny_llama_dir) as served:
        yield served


@pytest.fixture(scope="module")
def url(served):
    return served[0].url


@pytest.fixture(scope="module")
def aengine(served):
    return served[1]


@pytest.fixture(scope="module")
def model(aengine):
    return aengine.engine.config.model.name


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _offline(llm, prompts, **kw):
    return [o.outputs[0].text for o in llm.generate(prompts, _greedy(**kw))]


def _wait_idle(aengine, timeout=10.0) -> bool:
    """All KV blocks back in the pool and no request left in the scheduler."""
    kv, sched = aengine.engine.core.kv, aengine.engine.core.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kv.num_free_blocks == kv.num_usable_blocks and not sched.requests:
            return True
        time.sleep(0.02)
    return False


def _wait_dropped(aengine, timeout=30.0) -> None:
    """Until the server has seen a client's disconnect and dropped its request."""
    deadline = time.monotonic() + timeout
    while aengine.num_in_flight():
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.01)


def _sse_events(raw: str) -> list[str]:
    """SSE as OpenAI frames it: every event is one `data: ...` line followed by a blank line."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: ") :] for e in events]


# ---- completions --------------------------------------------------------------------------
def test_completion_sync_equals_offline(client, model, tiny_llama_llm):
    prompt = PROMPTS[0]
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == model
    (choice,) = resp.choices
    assert choice.text == _offline(tiny_llama_llm, [prompt])[0]
    assert choice.finish_reason == "length" and choice.index == 0
    n_prompt = len(tiny_llama_llm.get_tokenizer().encode(prompt))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        n_prompt,
        MAX_TOKENS,
        n_prompt + MAX_TOKENS,
    )


def test_completion_list_of_prompts_and_token_ids(client, model, tiny_llama_llm):
    tok = tiny_llama_llm.get_tokenizer()
    texts = PROMPTS[:3]
    want = _offline(tiny_llama_llm, texts)
    resp = client.completions.create(
        model=model, prompt=texts, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == want
    ids = [tok.encode(t) for t in texts]
    resp = client.completions.create(
        model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in resp.choices] == want
    assert resp.usage.prompt_tokens == sum(map(len, ids)) and resp.usage.completion_tokens == 3 * MAX_TOKENS
    resp = client.completions.create(
        model=model, prompt=ids[1], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in resp.choices] == want[1:2]


def test_completion_echo_stop_and_seed(client, model, tiny_llama_llm):
    prompt = PROMPTS[1]
    full = _offline(tiny_llama_llm, [prompt], max_tokens=24)[0]
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].text == prompt + full[: len(resp.choices[0].text) - len(prompt)]
    assert resp.choices[0].text.startswith(prompt) and len(resp.choices[0].text) > len(prompt)
    stop = full[6:9]
    assert stop.strip()
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    c = resp.choices[0]
    assert c.text == full[: full.find(stop)] and c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    a, b = (
        client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
        .choices[0]
        .text
        for _ in range(2)
    )
    assert a == b


def test_completion_logprobs(client, model, tiny_llama_llm):
    prompt = PROMPTS[2]
    want = tiny_llama_llm.generate([prompt], _greedy(logprobs=3))[0].outputs[0]
    resp = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    for tid, step, token, got, top in zip(want.token_ids, want.logprobs, lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert got == pytest.approx(step[tid].logprob, abs=1e-4)
        # the top 3 and the sampled token, keyed by text (distinct byte tokens may share one, e.g. '\ufffd')
        assert token in top and len(top) <= 4
        assert max(top.values()) == pytest.approx(max(e.logprob for e in step.values()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completion_stream_async_with_usage(url, model, tiny_llama_llm):
    prompt = PROMPTS[3]

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert all(ch.object == "text_completion" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == _offline(tiny_llama_llm, [prompt])[0]
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"
    assert all(ch.usage is None for ch in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.total_tokens == last.usage.prompt_tokens + MAX_TOKENS


def test_raw_sse_framing(url, model):
    body = {
        "model": model,
        "prompt": ["Hello", "The"],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for ch in chunks:
        assert set(ch) == {"id", "object", "created", "model", "choices"}
        assert ch["object"] == "text_completion" and len(ch["choices"]) == 1
    per_index = {0: [], 1: []}
    for ch in chunks:
        per_index[ch["choices"][0]["index"]].append(ch["choices"][0])
    for choices in per_index.values():
        assert choices[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])


# ---- chat ---------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world"}]


def test_chat_sync_equals_offline(client, model, tiny_llama_llm):
    want = tiny_llama_llm.chat(MESSAGES, _greedy())[0]
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids) and resp.usage.completion_tokens == MAX_TOKENS
    # content as a list of text parts, and max_completion_tokens, mean the same
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Hello world"}]}]
    resp2 = client.chat.completions.create(
        model=model, messages=parts, max_completion_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp2.choices[0].message.content == msg.content


def test_chat_stream_async(url, model, tiny_llama_llm):
    want = tiny_llama_llm.chat(MESSAGES, _greedy())[0].outputs[0].text

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=model,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_sync_stream_and_logprobs(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    entries = [e for ch in stream for e in ((ch.choices[0].logprobs.content or []) if ch.choices[0].logprobs else [])]
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the top token
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in resp.choices[0].logprobs.content)


# ---- other routes ---------------------------------------------------------------------------
def test_models_tokenize_detokenize_health_version(client, url, model, tiny_llama_llm):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].owned_by == "tokenmill"
    assert client.models.retrieve(model).id == model
    tok = tiny_llama_llm.get_tokenizer()
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
        assert len(r["token_strs"]) == r["count"]
        assert h.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
        chat = h.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == tiny_llama_llm.engine.apply_chat_template(MESSAGES)
        cont = h.post(
            "/tokenize",
            json={
                "messages": MESSAGES + [{"role": "assistant", "content": "Sure"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ).json()
        assert tok.decode(cont["tokens"]).endswith("<|im_start|>assistant\nSure")
        assert h.get("/health").status_code == 200
        assert h.get("/version").json()["version"]


def test_openapi_schema_types_every_field(url):
    with httpx.Client(base_url=url, timeout=30) as h:
        spec = h.get("/openapi.json").json()
    paths = spec["paths"]
    for p in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/version",
        "/metrics",
        "/generate",
        "/generate_stream",
    ):
        assert p in paths, p
    schemas = spec["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TGIRequest", "TGIParameters"):
        for field, sch in schemas[name]["properties"].items():
            assert any(k in sch for k in ("type", "anyOf", "$ref", "allOf", "oneOf")), (name, field)
    props = schemas["CompletionRequest"]["properties"]
    for f in (
        "prompt",
        "temperature",
        "top_p",
        "max_tokens",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "user",
        "n",
        "echo",
        "suffix",
        "stream_options",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
    ):
        assert f in props, f
    assert {"max_completion_tokens", "top_logprobs", "messages"} <= set(schemas["ChatCompletionRequest"]["properties"])


def _scrape(url) -> dict:
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" not in s.labels:
                out[key] = s.value
    return out


def test_metrics_present_and_counting(client, url, model, aengine):
    assert _wait_idle(aengine)
    before = _scrape(url)
    for name in (
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total",
        "tokenmill:time_to_first_token_seconds_count",
        "tokenmill:inter_token_latency_seconds_count",
        "tokenmill:e2e_request_latency_seconds_count",
        "tokenmill:request_queue_time_seconds_count",
        "tokenmill:request_success_total|finished_reason=length",
        "tokenmill:num_preemptions_total",
    ):
        assert name in before, name
    resp = client.completions.create(
        model=model, prompt="Hello world", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    deadline = time.monotonic() + 5
    while True:  # the engine thread records a step just after handing out its outputs
        after = _scrape(url)
        if after["tokenmill:e2e_request_latency_seconds_count"] > before["tokenmill:e2e_request_latency_seconds_count"]:
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)

    def delta(k):
        return after[k] - before[k]

    assert delta("tokenmill:prompt_tokens_total") == resp.usage.prompt_tokens
    assert delta("tokenmill:generation_tokens_total") == 7
    assert delta("tokenmill:request_success_total|finished_reason=length") == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"tokenmill:{h}_count") == 1, h
    assert delta("tokenmill:inter_token_latency_seconds_count") == 6
    assert after["tokenmill:num_requests_running"] == 0 and after["tokenmill:kv_cache_usage_perc"] == 0


# ---- disconnects and concurrency ------------------------------------------------------------
@contextlib.contextmanager
def _observed(aengine, hook, release: threading.Event):
    """hook(outputs, dt) after every engine step while the block runs; then release set, hook gone."""
    aengine.step_observers.append(hook)
    try:
        yield
    finally:
        release.set()
        aengine.step_observers.remove(hook)


@contextlib.contextmanager
def _raw_post(url: str, body: dict):
    """POST /v1/completions on a bare socket, the client gone when the block ends."""
    data = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
        )
        yield s


def test_stream_disconnect_aborts_and_frees_blocks(url, model, aengine):
    assert _wait_idle(aengine)
    kv = aengine.engine.core.kv
    baseline = kv.num_free_blocks
    aborts = _scrape(url)["tokenmill:request_success_total|finished_reason=abort"]
    body = {
        "model": model,
        "prompt": "Hello world",
        "max_tokens": 480,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    steps, release = [], threading.Event()

    def hold(outputs, _dt):  # once 3 chunks of text are out, the engine waits until the client has hung up
        steps.extend(o for o in outputs if o.outputs[0].delta_text)
        if len(steps) >= 3:
            release.wait(30)

    with _observed(aengine, hold, release):
        with httpx.Client(base_url=url, timeout=30) as h:
            with h.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
                assert kv.num_free_blocks < baseline  # the request holds blocks while it runs
            # leaving the block closes the connection mid-stream
        _wait_dropped(aengine)
    assert _wait_idle(aengine), "the aborted request's KV blocks did not come back"
    assert kv.num_free_blocks == baseline
    assert _scrape(url)["tokenmill:request_success_total|finished_reason=abort"] == aborts + 1


def test_non_streaming_disconnect_aborts(url, model, aengine):
    assert _wait_idle(aengine)
    aborts = _scrape(url)["tokenmill:request_success_total|finished_reason=abort"]
    running, release = threading.Event(), threading.Event()

    def hold(outputs, _dt):  # the engine waits after each step until the client is gone
        if outputs:
            running.set()
            release.wait(30)

    with _observed(aengine, hold, release):
        with _raw_post(
            url, {"model": model, "prompt": "Hello world", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        ):
            assert running.wait(30)  # generating, and held: it cannot finish before we hang up
        _wait_dropped(aengine)
    assert _wait_idle(aengine)
    assert _scrape(url)["tokenmill:request_success_total|finished_reason=abort"] == aborts + 1


def test_beam_search_disconnect_counts_its_aborted_round(url, model, aengine):
    """A client gone mid-beam-search: the round in flight (one engine request per beam) counts as
    aborted, as a sampled request's disconnect does."""
    assert _wait_idle(aengine)
    aborts = _scrape(url)["tokenmill:request_success_total|finished_reason=abort"]
    held, release = threading.Event(), threading.Event()

    def hold(outputs, _dt):  # after the first round finished, the engine waits until the client is gone
        if not held.is_set() and any(o.finished for o in outputs):
            held.set()
            release.wait(30)

    with _observed(aengine, hold, release):
        with _raw_post(
            url,
            {
                "model": model,
                "prompt": "Hello world",
                "max_tokens": 8,
                "n": 3,
                "use_beam_search": True,
                "ignore_eos": True,
            },
        ):
            assert held.wait(30)
            deadline = time.monotonic() + 30
            while aengine.num_in_flight() != 3:  # the second round: one request per beam, queued
                assert time.monotonic() < deadline, "the second round did not start"
                time.sleep(0.01)
        _wait_dropped(aengine)
    assert _wait_idle(aengine)
    assert _scrape(url)["tokenmill:request_success_total|finished_reason=abort"] == aborts + 3


def test_32_concurrent_streams_each_get_their_own_text(url, model, aengine, tiny_llama_llm):
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 4)]
    assert len(prompts) == 32
    max_tokens = 16
    want = _offline(tiny_llama_llm, prompts, max_tokens=max_tokens)
    batch_sizes = []

    def observe(outputs, _dt):
        batch_sizes.append(len(outputs))

    aengine.step_observers.append(observe)

    async def one(c, prompt):
        stream = await c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    try:
        got = asyncio.run(main())
    finally:
        aengine.step_observers.remove(observe)
    assert got == want
    assert max(batch_sizes) >= 8, "concurrent clients should be batched together"
    assert _wait_idle(aengine)


def test_prefix_cache_in_usage_and_metrics(client, url, model, aengine):
    assert _wait_idle(aengine)
    prompt = "A long shared system prompt that many requests start with. " * 3 + "Question one?"
    before = _scrape(url)
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details is not None
    bs = aengine.engine.config.cache.block_size
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (second.usage.prompt_tokens - 1) // bs * bs > 0
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    after = _scrape(url)
    hits = after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
    queries = after["tokenmill:prefix_cache_queries_total"] - before["tokenmill:prefix_cache_queries_total"]
    assert hits >= cached
    assert queries == first.usage.prompt_tokens + again.usage.prompt_tokens + second.usage.prompt_tokens
    assert 0 < after["tokenmill:prefix_cache_hit_rate"] <= 1


def _hf_prompt_logprobs(model_dir, ids):
    import torch
    from hf_oracle import load_hf

    with torch.no_grad():
        lp = torch.log_softmax(load_hf(model_dir)(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_echo_logprobs_for_scoring(client, model, aengine, tiny_llama_dir, url):
    """What evaluation harnesses send for log-likelihoods: echo, max_tokens 0 (or 1), logprobs."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = aengine.engine.tokenizer.encode(prompt)
    ref = _hf_prompt_logprobs(tiny_llama_dir, ids)
    for _ in range(2):  # the second time the prompt's blocks are cached: prompt logprobs must bypass that
        r = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=2)
        lp = r.choices[0].logprobs
        assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref)) < 1e-3
        assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    r = client.completions.create(
        model=model, prompt=prompt, echo=True, max_tokens=3, logprobs=1, temperature=0, extra_body={"ignore_eos": True}
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.text_offset[len(ids)] == len(prompt)  # generated tokens start after the echoed prompt
    assert r.choices[0].text.startswith(prompt)
    # Streaming: the prompt's logprobs lead the first chunk.
    body = {"model": model, "prompt": prompt, "echo": True, "max_tokens": 2, "logprobs": 0, "stream": True}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["token_logprobs"]) >= len(ids)
    assert max(abs(a - b) for a, b in zip(first["token_logprobs"][1 : len(ids)], ref)) < 1e-3
    assert _wait_idle(aengine)


def test_n_samples_share_the_prompt_and_are_indexed(client, model, aengine, url):
    prompt = "Parallel samples of one prompt share its KV blocks, " * 3
    kv = aengine.engine.core.kv
    assert _wait_idle(aengine)
    hits0 = kv.stats.hits
    r = client.completions.create(
        model=model,
        prompt=[prompt, "Another prompt"],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert len({c.text for c in r.choices[:3]}) > 1  # different samples
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == len(aengine.engine.tokenizer.encode(prompt)) + len(
        aengine.engine.tokenizer.encode("Another prompt")
    )
    bs = aengine.engine.config.cache.block_size
    # Samples 2 and 3 of the long prompt found its full blocks cached by sample 1.
    assert kv.stats.hits - hits0 >= 2 * ((len(aengine.engine.tokenizer.encode(prompt)) - 1) // bs * bs)
    # Seeded: the same request gives the same samples.
    again = client.completions.create(
        model=model,
        prompt=[prompt, "Another prompt"],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    # best_of: the 2 most likely of 4 samples, in order.
    b = client.completions.create(
        model=model,
        prompt=prompt,
        n=2,
        best_of=4,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    sums = [sum(c.logprobs.token_logprobs) for c in b.choices]
    assert len(b.choices) == 2 and sums[0] >= sums[1]
    # Chat, streaming: every choice opens with the role and ends with a finish reason.
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "n": 2,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    roles, finishes, usage = set(), {}, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for ch in ev["choices"]:
                if ch["delta"].get("role"):
                    roles.add(ch["index"])
                if ch["finish_reason"]:
                    finishes[ch["index"]] = ch["finish_reason"]
    assert roles == {0, 1} and finishes == {0: "length", 1: "length"}
    assert usage["completion_tokens"] == 8
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4, temperature=1.0, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert _wait_idle(aengine)


def test_beam_search_over_http(client, model, tiny_llama_llm, url):
    from tokenmill.beam_search import BeamSearchParams

    prompt = "Hello world, the quick"
    want = tiny_llama_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    r = client.completions.create(
        model=model, prompt=prompt, n=3, max_tokens=6, extra_body={"use_beam_search": True, "ignore_eos": True}
    )
    assert [c.text for c in r.choices] == [s.text for s in want.sequences]
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=5,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2
    bad = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": model, "prompt": "x", "stream": True, "use_beam_search": True},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def test_prompt_logprobs_field(client, model, aengine, tiny_llama_dir):
    prompt = "The quick brown fox"
    ids = aengine.engine.tokenizer.encode(prompt)
    ref = _hf_prompt_logprobs(tiny_llama_dir, ids)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert max(abs(plp[i + 1][str(ids[i + 1])]["logprob"] - ref[i]) for i in range(len(ids) - 1)) < 1e-3
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
