"""Multi-LoRA through the server: `model` = an adapter on the OpenAI routes and `parameters.adapter_id`
on TGI's, /v1/models, loading and unloading at run time with the official `openai` client, the
errors (400 / 404 with OpenAI's bodies, TGI's 422), the lora_name label and lora_requests_info, and
the flags. A real uvicorn server over the tiny random Llama (float32), checked against an offline
LLM with the same adapters."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
from lora_adapters import make_adapter
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import build_tiny_model

pytest.importorskip("peft")

from tokenmill import LLM, LoRARequest, SamplingParams  # noqa: E402

N = 8
PROMPTS = ["Hello world, the quick", "def add(a, b):"]
MESSAGES = [{"role": "user", "content": "Paged attention keeps the KV cache"}]
KEY = "sk-lora"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-lora")
    other = build_tiny_model(root / "wide", "llama", hidden_size=96, intermediate_size=192)
    return {
        "sql": make_adapter(tiny_llama_dir, root / "sql", rank=8, seed=11),
        "chat": make_adapter(
            tiny_llama_dir, root / "chat", rank=16, targets=["q_proj", "v_proj", "down_proj"], seed=12
        ),
        "late": make_adapter(
            tiny_llama_dir, root / "late", rank=8, targets=["gate_proj", "up_proj", "o_proj"], seed=13
        ),
        # refused at load
        "shapes": make_adapter(str(other), root / "shapes", rank=8, seed=14),
        "rank32": make_adapter(tiny_llama_dir, root / "rank32", rank=32, seed=15),
        "save": make_adapter(tiny_llama_dir, root / "save", rank=8, seed=16, modules_to_save=["lm_head"]),
        "missing": str(root / "nowhere"),
    }


@contextlib.contextmanager
def _server(model_dir: str, api_key: str | None = None, **engine_kwargs):
    """running_server, with an API key."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.server.app import BackgroundServer, build_app
    from tokenmill.server.args import ServerArgs

    aengine = AsyncLLMEngine.from_args(model_dir, dtype="float32", kv_cache_memory=0.05, **engine_kwargs)
    server = BackgroundServer(build_app(aengine, ServerArgs(api_key=api_key)))
    try:
        yield server.start(), aengine
    finally:
        server.stop()
        aengine.shutdown()


@pytest.fixture(scope="module")
def served(tiny_llama_dir, adapters):
    modules = [f"sql={adapters['sql']}", json.dumps({"name": "chat", "path": adapters["chat"]})]
    with _server(
        tiny_llama_dir,
        api_key=KEY,
        served_model_name="tiny",
        enable_lora=True,
        lora_modules=modules,
        max_loras=2,
        max_lora_rank=16,
        allow_runtime_lora_updating=True,
    ) as served:
        yield served


@pytest.fixture(scope="module")
def url(served):
    return served[0].url


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, enable_lora=True, max_loras=3, max_lora_rank=16)


@pytest.fixture(scope="module")
def lora(adapters):
    return {name: LoRARequest(name, i, adapters[name]) for i, name in enumerate(("sql", "chat", "late"), start=1)}


GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
EXTRA = {"ignore_eos": True}


def _want(offline, prompts, lr=None) -> list[str]:
    return [o.outputs[0].text for o in offline.generate(prompts, GREEDY, lora_request=lr, use_tqdm=False)]


def _complete(client, model, prompts=PROMPTS):
    r = client.completions.create(model=model, prompt=prompts, max_tokens=N, temperature=0, extra_body=EXTRA)
    assert r.model == model
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _load(client, name, path) -> str:
    return client.post("/load_lora_adapter", body={"lora_name": name, "lora_path": path}, cast_to=str)


def _unload(client, name) -> str:
    return client.post("/unload_lora_adapter", body={"lora_name": name}, cast_to=str)


def _error(e: openai.APIStatusError) -> dict:
    body = e.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == e.status_code
    return body["error"]


def test_models_list_adapters(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "sql", "chat"]
    assert cards["tiny"].parent is None
    for name in ("sql", "chat"):
        assert cards[name].parent == "tiny" and cards[name].root == adapters[name]
    card = client.models.retrieve("chat")
    assert card.id == "chat" and card.parent == "tiny" and card.root == adapters["chat"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nobody")


def test_completions_and_chat_pick_the_adapter(client, offline, lora):
    base = _want(offline, PROMPTS)
    assert _complete(client, "tiny") == base
    for name in ("sql", "chat"):
        want = _want(offline, PROMPTS, lora[name])
        assert want != base  # the adapter changes the output
        assert _complete(client, name) == want
    ids = offline.engine.apply_chat_template(MESSAGES)
    for name in ("tiny", "sql"):
        want = (
            offline.generate(
                prompt_token_ids=[ids], sampling_params=GREEDY, lora_request=lora.get(name), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        r = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=N, temperature=0, extra_body=EXTRA)
        assert r.model == name and r.choices[0].message.content == want
        chunks = list(
            client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=N, temperature=0, stream=True, extra_body=EXTRA
            )
        )
        assert {c.model for c in chunks} == {name}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_mixed_concurrent_requests(client, offline, lora):
    """Requests for both adapters and the base model at once (one batch) get their own tokens."""
    want = {m: _want(offline, PROMPTS, lora.get(m)) for m in ("tiny", "sql", "chat")}
    got: dict[str, list[str]] = {}
    threads = [threading.Thread(target=lambda m=m: got.__setitem__(m, _complete(client, m))) for m in want]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want


def test_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nobody", prompt="Hi", max_tokens=2)
    err = _error(e.value)
    assert "nobody" in err["message"] and err["param"] == "model" and err["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nobody", messages=MESSAGES, max_tokens=2)


def test_load_use_unload(client, offline, lora, adapters):
    want = _want(offline, PROMPTS, lora["late"])
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    assert "added successfully" in _load(client, "late", adapters["late"])
    assert "late" in [m.id for m in client.models.list().data]
    assert _complete(client, "late") == want
    assert "removed successfully" in _unload(client, "late")
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    assert "late" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError) as e:
        _unload(client, "late")
    assert "cannot be found" in _error(e.value)["message"]
    # loaded again under the same name: served again, the same tokens
    _load(client, "late", adapters["late"])
    assert _complete(client, "late") == want
    _unload(client, "late")


def test_unload_while_running(client, offline, lora, adapters):
    """A request already running with an adapter finishes with it after the unload."""
    sp = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    want = offline.generate(PROMPTS[:1], sp, lora_request=lora["late"], use_tqdm=False)[0].outputs[0].text
    _load(client, "late", adapters["late"])
    stream = client.completions.create(
        model="late", prompt=PROMPTS[0], max_tokens=300, temperature=0, stream=True, extra_body=EXTRA
    )
    parts, after = [], 0
    for chunk in stream:
        if not parts:
            _unload(client, "late")
        else:
            after += 1
        parts.append(chunk.choices[0].text if chunk.choices else "")
    assert after > 10  # still running when unloaded
    assert "".join(parts) == want
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")


@pytest.mark.parametrize(
    "name, path, words",
    [
        ("m", "missing", "does not exist"),
        ("s", "shapes", "another base model"),
        ("r", "rank32", "--max-lora-rank"),
        ("x", "save", "modules_to_save"),
        ("sql", "late", "already been loaded"),
        ("tiny", "late", "base model's name"),
    ],
)
def test_bad_loads_400(client, adapters, name, path, words):
    with pytest.raises(openai.BadRequestError) as e:
        _load(client, name, adapters[path])
    err = _error(e.value)
    assert words in err["message"] and err["type"] == "BadRequestError"
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "chat"]
    with pytest.raises(openai.BadRequestError):  # both fields are needed
        client.post("/load_lora_adapter", body={"lora_name": "y"}, cast_to=str)


def test_lora_routes_need_the_key(url, adapters):
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": adapters["late"]})
    assert r.status_code == 401
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 401
    assert httpx.get(url + "/v1/models").status_code == 401
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)


def test_tgi_adapter_id(url, offline, lora):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=auth, timeout=60) as h:
        for adapter in (None, "tiny", "sql", "chat"):
            params = {"max_new_tokens": N, **({"adapter_id": adapter} if adapter else {})}
            r = h.post("/generate", json={"inputs": PROMPTS[0], "parameters": params})
            assert r.status_code == 200, r.text
            assert r.json()["generated_text"] == _want(offline, PROMPTS[:1], lora.get(adapter or ""))[0]
        r = h.post("/generate", json={"inputs": PROMPTS[0], "parameters": {"adapter_id": "nobody"}})
        assert r.status_code == 422
        assert r.json()["error_type"] == "validation" and "nobody" in r.json()["error"]
        with h.stream(
            "POST",
            "/generate_stream",
            json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": N, "adapter_id": "sql"}},
        ) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1]["generated_text"] == _want(offline, PROMPTS[:1], lora["sql"])[0]


def test_metrics_by_adapter(client, url):
    _complete(client, "sql", PROMPTS[:1])
    _complete(client, "tiny", PROMPTS[:1])
    fams = _scrape(url)
    info = fams["tokenmill:lora_requests_info"].samples
    assert len(info) == 1
    assert info[0].labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert info[0].value > 1e9  # a time
    done = {
        (s.labels["lora_name"], s.labels["finished_reason"]): s.value for s in fams["tokenmill:request_success"].samples
    }
    assert done[("sql", "length")] >= 1 and done[("", "length")] >= 1 and ("", "abort") in done
    tokens = {s.labels["lora_name"]: s.value for s in fams["tokenmill:generation_tokens"].samples}
    assert tokens["sql"] >= N and tokens[""] >= N


def _scrape(url) -> dict:
    page = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {f.name: f for f in text_string_to_metric_families(page)}


def test_lora_requests_info_while_running(client, url):
    """The running adapter's name while its request runs; a client that goes away is counted as an
    abort under the adapter's lora_name."""

    def aborts():
        return next(
            s.value
            for s in _scrape(url)["tokenmill:request_success"].samples
            if s.labels["lora_name"] == "chat" and s.labels["finished_reason"] == "abort"
        )

    before = (
        aborts()
        if any(
            s.labels["lora_name"] == "chat" and s.labels["finished_reason"] == "abort"
            for s in _scrape(url)["tokenmill:request_success"].samples
        )
        else 0
    )
    stream = client.completions.create(
        model="chat", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True, extra_body=EXTRA
    )
    for i, _ in enumerate(stream):
        if i == 2:
            info = _scrape(url)["tokenmill:lora_requests_info"].samples[0].labels
            break
    stream.close()
    assert info["running_lora_adapters"] == "chat" and info["waiting_lora_adapters"] == ""
    deadline = time.monotonic() + 30
    while aborts() != before + 1:
        assert time.monotonic() < deadline, "the abort was not counted under lora_name=chat"
        time.sleep(0.05)


def test_runtime_loading_off(tiny_llama_dir, adapters):
    """Without --allow-runtime-lora-updating the routes answer 404 saying how to turn them on (and
    are not in the schema); adapters from --lora-modules still serve."""
    with _server(tiny_llama_dir, enable_lora=True, lora_modules=[f"sql={adapters['sql']}"]) as (server, _):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            for call in (lambda: _load(c, "late", adapters["late"]), lambda: _unload(c, "sql")):
                with pytest.raises(openai.NotFoundError) as e:
                    call()
                assert "--allow-runtime-lora-updating" in _error(e.value)["message"]
            assert [m.id for m in c.models.list().data][1:] == ["sql"]
            assert c.completions.create(model="sql", prompt="Hi", max_tokens=2).model == "sql"
        paths = httpx.get(server.url + "/openapi.json").json()["paths"]
        assert "/v1/load_lora_adapter" not in paths and "/v1/completions" in paths
        page = httpx.get(server.url + "/metrics").text
        assert 'tokenmill:lora_requests_info{max_lora="1"' in page


def test_cli_flags(monkeypatch):
    from tokenmill.cli import build_parser
    from tokenmill.engine.arg_utils import engine_args_from

    ns = build_parser().parse_args(
        [
            "serve",
            "m",
            "--enable-lora",
            "--lora-modules",
            "a=/x",
            '{"name": "b", "path": "/y", "base_model_name": "m"}',
            "--lora-modules",
            "c=/z",
            "--max-loras",
            "4",
            "--max-lora-rank",
            "64",
            "--max-cpu-loras",
            "8",
        ]
    )
    args = engine_args_from(ns)
    assert args.enable_lora and args.lora_modules == [
        "a=/x",
        '{"name": "b", "path": "/y", "base_model_name": "m"}',
        "c=/z",
    ]
    assert (args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (4, 64, 8)
    assert not args.allow_runtime_lora_updating
    from tokenmill.lora.config import parse_lora_modules

    assert [(m.lora_name, m.lora_path, m.base_model_name) for m in parse_lora_modules(args.lora_modules)] == [
        ("a", "/x", None),
        ("b", "/y", "m"),
        ("c", "/z", None),
    ]
    assert build_parser().parse_args(["serve", "--allow-runtime-lora-updating"]).allow_runtime_lora_updating
    for value, on in (("True", True), ("1", True), ("true", True), ("0", False), ("False", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert build_parser().parse_args(["serve"]).allow_runtime_lora_updating is on
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert not build_parser().parse_args(["serve", "--no-allow-runtime-lora-updating"]).allow_runtime_lora_updating
