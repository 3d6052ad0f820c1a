"""tokenmill on Ray Serve: a real local Ray (127.0.0.1, 2 CPUs, no dashboard, one per module, always
shut down), two engine replicas of a tiny model behind one endpoint.

Nothing here waits on timing: a request is held *running* on its replica by a step observer
(installed through build_app's replica_setup) that blocks that replica's engine thread on a
Ray actor (Gate) until the test releases it or kills the replica; everything else is polled as
a condition with a deadline.
"""

from __future__ import annotations

import functools
import json
import socket
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

from ray import cloudpickle  # noqa: E402  (Ray's own copy: the one that pickles for its workers)

from tokenmill.ray_serve import IngressOptions, ReplicaOptions, app_builder, build_app  # noqa: E402
from tokenmill.ray_serve.routing import PrefixTable, prefix_block_hashes  # noqa: E402

# The replica_setup hook below runs inside the replicas, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GATE_NAMESPACE = "tokenmill-tests"
# 96 tokens or so of a shared prefix: several full KV blocks (16 tokens) for prefix affinity.
SHARED = "Paged attention keeps the KV cache in fixed-size blocks. " * 6
HOLD_SPREAD = SHARED + "Hold this one while another request runs elsewhere."
VICTIM_PREFIX = "Continuous batching admits new requests every step. " * 8
HOLD_VICTIM = VICTIM_PREFIX + "This replica will be killed."
HOLD_SCALE = "def add(a, b):\n    return a + b\n" * 4 + "# two of these make the autoscaler add a replica"
DEADLINE_S = 120.0


@ray.remote(num_cpus=0)
class Gate:
    """Named events: replicas wait on them (from an engine step observer), the test sets them."""

    def __init__(self):
        import asyncio

        self.events: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, int] = {}

    def _event(self, name: str):
        import asyncio

        return self.events.setdefault(name, asyncio.Event())

    async def wait(self, name: str) -> None:
        self.waiting[name] = self.waiting.get(name, 0) + 1
        await self._event(name).wait()

    def release(self, name: str) -> None:
        self._event(name).set()

    def num_waiting(self, name: str) -> int:
        return self.waiting.get(name, 0)


def hold_requests(aengine, prompts: dict[str, str]) -> None:
    """replica_setup: after the first output of a request whose prompt is prompts[name], block the
    engine thread until the Gate releases `name` (or this replica is killed)."""
    tokenizer = aengine.engine.tokenizer
    targets = {tuple(tokenizer.encode(text)): name for name, text in prompts.items()}
    gate = ray.get_actor("gate", namespace=GATE_NAMESPACE)
    held: set[str] = set()

    def observer(outputs, step_seconds):
        for out in outputs:
            name = targets.get(tuple(out.prompt_token_ids))
            if name is not None and out.request_id not in held and not out.finished:
                held.add(out.request_id)
                ray.get(gate.wait.remote(name), timeout=DEADLINE_S)

    aengine.step_observers.append(observer)


def wait_for(condition, what: str, deadline_s: float = DEADLINE_S, interval_s: float = 0.1):
    """Poll `condition()` until it returns something truthy; fail after the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            pytest.fail(f"timed out after {deadline_s:g} s waiting for {what}")
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, request):
    """A local Ray, Serve's proxy on a free loopback port, and the app: 2 replicas x 1 thread."""
    ray.init(
        num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", namespace=GATE_NAMESPACE, log_to_driver=True
    )
    request.addfinalizer(ray.shutdown)
    request.addfinalizer(serve.shutdown)
    gate = Gate.options(name="gate", namespace=GATE_NAMESPACE).remote()
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {"model": tiny_llama_dir, "dtype": "float32", "kv_cache_memory": 0.01, "num_threads": 1}
    setup = functools.partial(
        hold_requests, prompts={"spread": HOLD_SPREAD, "victim": HOLD_VICTIM, "scale": HOLD_SCALE}
    )
    app = build_app(engine, ReplicaOptions(num_replicas=2, routing="prefix"), IngressOptions(), replica_setup=setup)
    serve.run(app, name="tokenmill", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return type("Cluster", (), {"url": url, "model": model, "gate": gate, "engine": engine, "setup": setup})


def health(cluster) -> dict:
    return httpx.get(cluster.url + "/health", timeout=30).json()


def served_per_replica(cluster) -> dict[str, float]:
    """Requests each replica has finished (any reason), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(cluster.url + "/metrics", timeout=30).text):
        if fam.name == "tokenmill:request_success":
            for s in fam.samples:
                counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return counts


def replica_with(cluster, key: str, at_least: int = 1) -> dict | None:
    return next((r for r in health(cluster)["replicas"] if r[key] >= at_least), None)


def all_idle(cluster, n: int = 2) -> list[dict] | None:
    """Every replica answering, nothing in flight and every KV block back in the pool."""
    replicas = health(cluster)["replicas"]
    idle = len(replicas) == n and all(
        r["healthy"]
        and r["running"] == 0
        and r["waiting"] == 0
        and r["in_flight"] == 0
        and r["free_blocks"] == r["usable_blocks"]
        and r["kv_cache_usage"] == 0.0
        for r in replicas
    )
    return replicas if idle else None


def sse_events(response: httpx.Response) -> list:
    """The data events of an SSE stream ("[DONE]" kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- routing, without a cluster --------------------------------------------------------------
def test_prefix_hashes_and_table():
    ids = list(range(100))
    hashes = prefix_block_hashes(ids, 16, 256)
    assert len(hashes) == 6  # full blocks only
    assert prefix_block_hashes(ids[:40] + [7] * 60, 16, 256)[:2] == hashes[:2]  # chained: same prefix, same hashes
    assert prefix_block_hashes(ids[:40] + [7] * 60, 16, 256)[2] != hashes[2]
    assert len(prefix_block_hashes(ids, 16, 3)) == 3
    table = PrefixTable(capacity=8)
    table.remember(hashes[:4], "a")
    assert table.match(hashes, {"a", "b"}) == ("a", 4)
    assert table.match(hashes, {"b"}) == (None, 0)  # a dead replica is never chosen
    table.remember(hashes, "b")  # the whole prompt went to b since: b holds all of it
    assert table.match(hashes, {"a", "b"}) == ("b", 6)
    table.remember(prefix_block_hashes(list(range(500, 600)), 16, 256), "a")
    assert len(table) == 8  # least recently used entries evicted
    table.forget("a")
    assert table.match(prefix_block_hashes(list(range(500, 600)), 16, 256), {"a", "b"}) == (None, 0)


def _router(policy: str):
    """A TokenmillRouter outside Serve, over two fake replicas (what choose_replicas reads of them)."""
    import asyncio
    import types

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from tokenmill.ray_serve.routing import TokenmillRouter

    dep = DeploymentID(name="TokenmillEngine", app_name="test")
    router = TokenmillRouter(
        deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    router.initialize_state(policy=policy, block_size=16, imbalance_threshold=8)
    replicas = [types.SimpleNamespace(replica_id=ReplicaID(name, dep), max_ongoing_requests=256) for name in "ab"]

    def choose(ids: list[int], parent: str | None = None) -> str:
        pending = types.SimpleNamespace(args=[ids, None, "req", parent])
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        assert sorted(r.replica_id.unique_id for r in ranks[-1]) == ["a", "b"]  # the fallback rank: all
        return ranks[0][0].replica_id.unique_id

    def set_load(name: str, n: int) -> None:
        router.replica_queue_len_cache.update(next(r.replica_id for r in replicas if r.replica_id.unique_id == name), n)

    return choose, set_load


def test_router_prefix_affinity_and_fallbacks(cluster):  # the cluster: Ray's metrics need a running Ray
    choose, set_load = _router("prefix")
    tenant = list(range(100, 180))  # 5 blocks
    first = choose(tenant + [1, 2, 3])
    other = "b" if first == "a" else "a"
    set_load(first, 5)  # busier, but within the imbalance threshold: affinity wins
    assert choose(tenant + [4, 5]) == first
    assert choose(list(range(300, 380)) + [1]) == other  # a new prefix: the least loaded
    set_load(first, 9)  # 9 above the other replica's 0 > 8: the least loaded instead, which now holds it
    assert choose(tenant + [6]) == other
    set_load(first, 0)
    set_load(other, 0)
    assert choose(tenant + [7]) == other  # the prefix's latest home
    # Samples of one request (one parent) stay together even without a full block to match.
    homes = {choose([9, 9, 9], parent="p1") for _ in range(4)}
    assert len(homes) == 1
    choose_rr, _ = _router("round_robin")
    assert [choose_rr(tenant) for _ in range(4)] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])


def test_options_and_config_file():
    with pytest.raises(ValueError, match="min-replicas must be >= 1"):
        ReplicaOptions(min_replicas=0).check()
    with pytest.raises(ValueError, match="above --max-replicas"):
        ReplicaOptions(min_replicas=3, max_replicas=2).check()
    with pytest.raises(ValueError, match="routing must be one of"):
        ReplicaOptions(routing="random").check()
    assert ReplicaOptions(num_replicas=2, max_replicas=4).bounds == (1, 4)
    import yaml

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "ray_serve_config.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "tokenmill.ray_serve:app_builder"
    app_builder(application["args"])  # every key is known and the options check out
    with pytest.raises(ValueError, match="unknown tokenmill application argument 'num_replica'"):
        app_builder({"num_replica": 2})


def test_cli_refuses_bad_replica_flags_before_starting_ray():
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--min-replicas", "0"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert r.returncode == 2
    assert "--min-replicas must be >= 1" in r.stderr, r.stderr


# ---- two replicas behind one endpoint -------------------------------------------------------
def test_two_replicas_stream_with_the_openai_client(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    before = served_per_replica(cluster)
    assert len(before) == 2, before
    # A stream held running on one replica (its engine blocked after the first token) ...
    held = client.completions.create(model=cluster.model, prompt=HOLD_SPREAD, max_tokens=8, temperature=0, stream=True)
    first = next(iter(held))
    assert first.choices[0].text is not None
    busy = wait_for(lambda: replica_with(cluster, "running"), "the held stream to run on a replica")
    # ... so the least-loaded fallback sends a new prompt to the other replica, which streams it.
    chunks = list(
        client.chat.completions.create(
            model=cluster.model,
            max_tokens=8,
            temperature=0,
            stream=True,
            messages=[{"role": "user", "content": "Hello world!"}],
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
    cluster.gate.release.remote("spread")
    rest = list(held)
    assert rest[-1].choices[0].finish_reason == "length"
    after = served_per_replica(cluster)
    assert sorted(after[r] - before[r] for r in after) == [1, 1], (before, after)
    assert after[busy["replica"]] - before[busy["replica"]] == 1
    # /health and /metrics speak for every replica; the KV blocks all went back.
    replicas = wait_for(lambda: all_idle(cluster), "both replicas idle with every KV block free")
    assert {r["replica"] for r in replicas} == set(after)
    page = httpx.get(cluster.url + "/metrics", timeout=30).text
    assert f'tokenmill:num_replicas{{model_name="{cluster.model}",state="healthy"}} 2.0' in page
    assert page.count("tokenmill:kv_cache_usage_perc{") == 2


def test_affinity_sends_a_repeated_prefix_to_one_replica(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    before = served_per_replica(cluster)
    hits_before = _prefix_hits(cluster)
    for i in range(6):
        out = client.completions.create(
            model=cluster.model, prompt=SHARED + f"Question {i}: why?", max_tokens=4, temperature=0
        )
        assert out.choices[0].finish_reason == "length"
    after = served_per_replica(cluster)
    assert sorted(after[r] - before[r] for r in after) == [0, 6], (before, after)
    # ... where the shared blocks came from its prefix cache: >= 2 blocks (16 tokens) for each later request.
    winner = max(after, key=lambda r: after[r] - before[r])
    hits = _prefix_hits(cluster)
    assert hits[winner] - hits_before[winner] >= 5 * 2 * 16, (hits_before, hits)


def _prefix_hits(cluster) -> dict[str, float]:
    return {s.labels["replica"]: s.value for s in _samples(cluster, "tokenmill:prefix_cache_hits")}


def _samples(cluster, family: str):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(cluster.url + "/metrics", timeout=30).text):
        if fam.name == family:
            yield from fam.samples


def test_bad_request_through_the_ingress(cluster):
    r = httpx.post(
        cluster.url + "/v1/completions", timeout=30, json={"model": cluster.model, "prompt": "Hello", "max_tokens": 0}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(cluster.url + "/v1/completions", timeout=30, json={"model": "nope", "prompt": "Hello"})
    assert r.status_code == 404


def test_embeddings_route_on_a_generating_app(cluster):
    """/v1/embeddings is served behind Ray Serve too; a generating model answers it with vLLM's 400."""
    r = httpx.post(cluster.url + "/v1/embeddings", timeout=30, json={"model": cluster.model, "input": "Hello"})
    assert r.status_code == 400 and "does not support Embeddings API" in r.json()["error"]["message"], r.text


def test_web_ui_through_the_ingress(cluster):
    page = httpx.get(cluster.url + "/", timeout=30)
    assert page.status_code == 200 and 'src="ui/main.js"' in page.text
    assert httpx.get(cluster.url + "/ui/dashboard.js", timeout=30).status_code == 200


def test_responses_and_messages_through_the_ingress(cluster):
    """The Responses and Anthropic Messages routes are served behind Ray Serve too (stored responses in the ingress)."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    first = client.responses.create(
        model=cluster.model,
        input="Hello world!",
        max_output_tokens=4,
        temperature=0,
        extra_body={"cache_salt": "tenant-a"},
    )  # vLLM's extras reach the replica too
    assert first.status == "incomplete" and first.usage.output_tokens == 4
    follow = client.responses.create(
        model=cluster.model, input="Again.", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert follow.usage.input_tokens > first.usage.input_tokens  # the stored turn came first
    r = httpx.post(
        cluster.url + "/v1/messages",
        timeout=DEADLINE_S,
        json={"model": cluster.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello world!"}]},
    )
    assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text


# ---- faults: a replica killed under load ----------------------------------------------------
def test_killed_replica_recovers_without_losing_unstarted_requests(cluster):
    import concurrent.futures

    url = cluster.url + "/v1/completions"
    body = {"model": cluster.model, "prompt": HOLD_VICTIM, "max_tokens": 32, "temperature": 0, "stream": True}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
    with httpx.Client(timeout=DEADLINE_S) as http, http.stream("POST", url, json=body) as victim:
        assert victim.status_code == 200  # the first token was generated: the stream is running
        lines = victim.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: ray.get(cluster.gate.num_waiting.remote("victim")) >= 1, "the victim's engine to block")
        doomed = wait_for(lambda: replica_with(cluster, "running"), "the victim's replica")
        # Requests sharing the victim's prefix follow it (affinity) and queue behind its blocked engine:
        # sent, not started.
        queued = [
            pool.submit(
                httpx.post,
                url,
                timeout=DEADLINE_S,
                json={
                    "model": cluster.model,
                    "prompt": VICTIM_PREFIX + f"Queued request {i}.",
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            for i in range(3)
        ]
        wait_for(
            lambda: next(
                (r for r in health(cluster)["replicas"] if r["replica"] == doomed["replica"] and r["in_flight"] >= 4),
                None,
            ),
            "three requests queued on the victim's replica",
        )
        ray.kill(ray.get_actor(doomed["actor_name"], namespace="serve"), no_restart=True)
        # The running stream ends with an error event and [DONE], never a hang.
        events = [
            json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in lines if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and "died" in events[-2]["error"]["message"], events[-2]
    # The queued requests went to the live replica.
    for f in queued:
        r = f.result(timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    pool.shutdown()
    # Serve replaces the killed replica; the survivor holds no KV block.
    replicas = wait_for(lambda: all_idle(cluster), "two healthy, idle replicas again", interval_s=0.5)
    assert doomed["replica"] not in {r["replica"] for r in replicas}
    # And the replacement serves.
    r = httpx.post(url, timeout=DEADLINE_S, json={"model": cluster.model, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- autoscaling (last: it redeploys the app) ------------------------------------------------
@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load(cluster):
    # 1 to 2 replicas, aiming at 1 ongoing request each; Serve's delays shortened so the test is quick.
    options = ReplicaOptions(
        num_replicas=1,
        min_replicas=1,
        max_replicas=2,
        target_ongoing_requests=1,
        extra_autoscaling_config={"upscale_delay_s": 0, "look_back_period_s": 12},
    )
    serve.delete("tokenmill")  # an update in place would keep both old replicas (all the CPUs) until the new one ran
    serve.run(build_app(cluster.engine, options, replica_setup=cluster.setup), name="tokenmill", route_prefix="/")
    wait_for(lambda: len(health(cluster)["replicas"]) == 1, "the autoscaled app to start with one replica")
    import concurrent.futures

    body = {"model": cluster.model, "prompt": HOLD_SCALE, "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        # Two requests held on the one replica: 2 ongoing > target 1.
        held = [
            pool.submit(httpx.post, cluster.url + "/v1/completions", json=body, timeout=DEADLINE_S) for _ in range(2)
        ]
        wait_for(lambda: replica_with(cluster, "in_flight", 2), "two requests on the replica")
        wait_for(lambda: len(health(cluster)["replicas"]) == 2, "the autoscaler to add a replica", interval_s=0.5)
        cluster.gate.release.remote("scale")
        for f in held:
            r = f.result(timeout=DEADLINE_S)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


# ---- embeddings (after autoscaling: it replaces the app) ---------------------------------------
def test_embeddings_through_the_ingress(cluster):
    """An embedding app (a decoder with --task embed): the vectors equal the offline engine's; a bad
    input gets OpenAI's 400 from the replica."""
    from tokenmill import LLM

    engine = {**cluster.engine, "task": "embed", "override_pooler_config": '{"pooling_type": "MEAN"}'}
    serve.delete("tokenmill")
    serve.run(build_app(engine, ReplicaOptions(num_replicas=1)), name="tokenmill", route_prefix="/")
    wait_for(lambda: len(health(cluster)["replicas"]) == 1, "the embedding app's replica")
    texts = ["Paged attention keeps the KV cache in blocks.", "Hello", "def add(a, b): return a + b"]
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
    got = client.embeddings.create(model=cluster.model, input=texts)
    assert [d.index for d in got.data] == [0, 1, 2] and got.usage.prompt_tokens > 0
    offline = LLM(**engine).embed(texts)
    for d, want in zip(got.data, offline):
        assert max(abs(a - b) for a, b in zip(d.embedding, want.outputs.embedding)) < 1e-5
    too_long = [1] * 10_000
    r = httpx.post(cluster.url + "/v1/embeddings", timeout=30, json={"model": cluster.model, "input": too_long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert wait_for(lambda: all_idle(cluster, n=1), "the replica idle, every KV block free")
