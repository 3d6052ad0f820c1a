"""vLLM's operational extras on the OpenAI routes, against a real server and the official client:
`cache_salt` (tenant isolation in the prefix cache), `priority` (refused under fcfs, as vLLM),
POST /reset_prefix_cache (under the API key) and /metrics under `--metrics-prefix vllm`."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server.app import BackgroundServer, build_app
from tokenmill.server.args import ServerArgs

KEY = "sk-extras"
# Long enough for several full KV blocks (16 tokens) under the tiny model's tokenizer.
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. " * 4
# The series vLLM's own Grafana dashboard (examples/observability/prometheus_grafana/grafana.json) reads,
# but request_max_num_generation_tokens (see README, Metrics prefix), plus the other vllm:* names we serve.
VLLM_DASHBOARD_FAMILIES = [
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:inter_token_latency_seconds",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_success",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
]
VLLM_OTHER_FAMILIES = [
    "vllm:request_inference_time_seconds",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    aengine = AsyncLLMEngine.from_args(tiny_llama_dir, dtype="float32", kv_cache_memory=0.05, served_model_name="tiny")
    srv = BackgroundServer(build_app(aengine, ServerArgs(api_key=KEY, metrics_prefix="vllm")))
    try:
        srv.start()
        with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            yield srv, client
    finally:
        srv.stop()
        aengine.shutdown()


def _cached(client, salt: str | None = None, prompt: str = PROMPT, chat: bool = False) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    if chat:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=1, extra_body=extra
        )
    else:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def _metrics(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_cache_salt_isolates_tenants(server):
    _, client = server
    assert _cached(client, "tenant-a") == 0
    assert _cached(client, "tenant-a") > 16  # same salt: the prompt's full blocks are shared
    assert _cached(client, "tenant-b") == 0  # another tenant never sees them
    assert _cached(client, None, PROMPT) == 0  # nor does an unsalted request
    assert _cached(client, "tenant-b") > 16
    assert _cached(client, "tenant-a", chat=True) == 0  # chat: another prompt (the template's)
    assert _cached(client, "tenant-a", chat=True) > 16
    assert _cached(client, "tenant-b", chat=True) == 0
    with pytest.raises(openai.BadRequestError) as e:
        _cached(client, "")
    assert e.value.body["param"] == "cache_salt"


def test_priority_refused_under_fcfs(server):
    _, client = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=1, extra_body={"priority": 1})
    assert e.value.body["param"] == "priority" and "--scheduling-policy priority" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"priority": -3}
        )
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=1, extra_body={"priority": 0})
    assert r.choices[0].finish_reason == "length"


def test_reset_prefix_cache(server):
    srv, client = server
    prompt = "Continuous batching admits new requests every step. " * 4
    _cached(client, prompt=prompt)
    assert _cached(client, prompt=prompt) > 16
    before = _metrics(srv)
    assert httpx.post(srv.url + "/reset_prefix_cache").status_code == 401  # under the API key
    r = httpx.post(srv.url + "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.content == b""
    assert _cached(client, prompt=prompt) == 0  # computed again
    after = _metrics(srv)
    # The counters keep counting across a reset: more queries, no new hits.
    assert after["vllm:prefix_cache_hits_total"] == before["vllm:prefix_cache_hits_total"]
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert _cached(client, prompt=prompt) > 16  # and the cache fills again


def test_metrics_prefix_vllm(server):
    srv, client = server
    client.completions.create(model="tiny", prompt="Hello world", max_tokens=3)
    text = httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    families = {fam.name: fam for fam in text_string_to_metric_families(text)}
    for name in VLLM_DASHBOARD_FAMILIES + VLLM_OTHER_FAMILIES:
        assert name in families, name
        assert all(s.labels.get("model_name") == "tiny" for s in families[name].samples), name
    assert "tokenmill:" not in text
    assert 'vllm:num_requests_running{model_name="tiny"}' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text
    samples = {s.name: s.value for fam in families.values() for s in fam.samples}
    assert samples["vllm:request_generation_tokens_count"] >= 1
    assert samples["vllm:request_prefill_time_seconds_count"] == samples["vllm:request_decode_time_seconds_count"]
