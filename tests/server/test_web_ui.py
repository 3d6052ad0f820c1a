"""The web playground and dashboard at `/`, driven in a real browser: Debian's Chromium
(/usr/bin/chromium, never a downloaded browser) through Playwright, against a real server over
the tiny random model, with an API key the page has to be given.

Screenshots of each browser test go to a pytest temporary folder (printed; kept as test artefacts).
TOKENMILL_WEB_UI_SCREENSHOTS=docs/img also runs test_readme_screenshots, which takes the README's
docs/img/playground.png and docs/img/dashboard.png on SmolLM2 (the dashboard under load).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import running_server
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-web-ui-test"
CHROMIUM = os.environ.get("TOKENMILL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# As root, on a machine with no outside network: no sandbox, and no background connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
]
UI_TIMEOUT_MS = 60_000  # the page's own waits; generous: CI machines are shared and slow
SHOTS_ENV = "TOKENMILL_WEB_UI_SCREENSHOTS"


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright; .ci/run installs it)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)"
    return None


def needs_browser(test):
    """Marked `browser`; skipped without Playwright and Chromium."""
    return pytest.mark.browser(pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))(test))


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """The tiny model behind a server with an API key: .url, .aengine."""
    with running_server(tiny_llama_dir, app_kwargs={"api_key": KEY}) as (server, aengine):
        yield types.SimpleNamespace(url=server.url, aengine=aengine)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("web-ui-screenshots")
    print(f"\nweb UI screenshots: {out}")
    return out


def _open(browser, url: str, view: str = "playground", key: str | None = KEY):
    """A fresh page (its own localStorage) on the UI, its API key typed into the key field."""
    page = browser.new_context(viewport={"width": 1280, "height": 860}).new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(f"{url}/#{view}")
    if key is not None:
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")  # `change`: stored, and the models are read again
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    return page


def _scrape(url: str) -> dict[str, float]:
    return _scrape_text(httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text)


def _scrape_text(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")] = s.value
    return out


def _until(cond, what: str, timeout: float = 60.0):
    """Poll cond() until it is truthy (bounded); returns its value."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


class Hold:
    """A step observer that stops the engine thread once `when(outputs)` has been true, until
    released: the page cannot move past a point before the test has looked at it."""

    def __init__(self, aengine, when):
        self.aengine, self.when = aengine, when
        self.reached, self.release = threading.Event(), threading.Event()

    def __call__(self, outputs, _dt):
        if not self.reached.is_set() and self.when(outputs):
            self.reached.set()
        if self.reached.is_set():
            self.release.wait(60)

    def __enter__(self) -> Hold:
        self.aengine.step_observers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.aengine.step_observers.remove(self)


def _settings(page, *, max_tokens: int, extra: dict | None = None, temperature: float = 0.0) -> None:
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#extra", json.dumps(extra) if extra else "")


def _send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def _last_answer(page) -> str:
    return page.locator("#messages .msg.assistant").last.text_content()


def _tile(page, name: str) -> float:
    value = page.get_attribute(f"#tile-{name}", "data-value")
    return float(value) if value else 0.0


# ---- without a browser ---------------------------------------------------------------------------
def test_page_is_public_and_its_data_calls_need_the_key(served):
    url = served.url
    with httpx.Client(base_url=url, timeout=30) as h:
        page = h.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="ui/main.js"' in page.text  # relative: works under --root-path
        for asset in ("main.js", "api.js", "prom.js", "chart.js", "dashboard.js", "playground.js", "style.css"):
            assert h.get(f"/ui/{asset}").status_code == 200, asset
        auth = {"Authorization": f"Bearer {KEY}"}
        for path in ("/v1/models", "/metrics", "/version"):
            assert h.get(path).status_code == 401, path
            assert h.get(path, headers=auth).status_code == 200, path
        body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert h.post("/v1/chat/completions", json=body).status_code == 401
        assert "/" not in h.get("/openapi.json", headers=auth).json()["paths"]  # the page is no API route


def test_disable_web_ui_gives_404(tiny_llama_dir):
    with running_server(tiny_llama_dir, app_kwargs={"disable_web_ui": True}) as (server, _):
        with httpx.Client(base_url=server.url, timeout=30) as h:
            assert h.get("/").status_code == 404
            assert h.get("/ui/main.js").status_code == 404
            assert h.get("/v1/models").status_code == 200  # the API itself is unchanged


def test_cli_flag():
    from tokenmill.cli import build_parser

    assert build_parser().parse_args(["serve", "--disable-web-ui"]).disable_web_ui is True
    assert build_parser().parse_args(["serve"]).disable_web_ui is False


# ---- in the browser --------------------------------------------------------------------------------
@needs_browser
def test_key_field_unlocks_the_page(browser, served):
    url = served.url
    page = browser.new_context().new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    page.goto(url + "/")
    page.wait_for_selector("#banner:not([hidden])")
    assert "API key" in page.text_content("#banner")
    assert page.locator("#model option").count() == 0
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.wait_for_selector("#banner", state="hidden")  # the dashboard's next /metrics call works too
    assert page.evaluate("localStorage.getItem('tokenmill.apiKey')") == KEY
    page.reload()  # the key is kept in localStorage
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    assert page.input_value("#api-key") == KEY
    page.context.close()


@needs_browser
def test_chat_streams_the_same_answer_as_the_api(browser, served, shots):
    url = served.url
    page = _open(browser, url)
    model = page.input_value("#model")
    _settings(page, max_tokens=24, extra={"ignore_eos": True})
    page.fill("#system", "You are terse.")
    page.fill("#seed", "7")
    _send(page, "Hello world, the quick")
    page.wait_for_selector('#stats[data-state="done"]')
    answer = _last_answer(page)
    stats = page.text_content("#stats")
    assert "TTFT" in stats and "24 tokens" in stats and "tokens/s" in stats and "finish: length" in stats, stats
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        want = client.chat.completions.create(
            model=model,
            max_tokens=24,
            temperature=0,
            seed=7,
            top_p=1,
            extra_body={"ignore_eos": True},
            messages=[
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello world, the quick"},
            ],
        )
    assert answer == want.choices[0].message.content
    # a second turn sends the conversation back, the first answer in it
    _send(page, "And then?")
    page.wait_for_function("document.querySelectorAll('#messages .msg.assistant').length == 2")
    page.wait_for_selector('#stats[data-state="done"]')
    assert page.locator("#messages .msg.user").count() == 2
    page.screenshot(path=str(shots / "playground.png"))
    page.context.close()


@needs_browser
def test_stop_aborts_the_request(browser, served, shots):
    url, aengine = served.url, served.aengine
    before = _scrape(url)
    page = _open(browser, url)
    _settings(page, max_tokens=480, extra={"ignore_eos": True})
    text_steps = []

    def three_chunks_out(outputs):
        text_steps.extend(o for o in outputs if o.outputs[0].delta_text)
        return len(text_steps) >= 3

    with Hold(aengine, three_chunks_out) as hold:  # the engine waits mid-stream: it cannot finish first
        _send(page, "Paged attention keeps")
        assert hold.reached.wait(60)
        page.wait_for_function("document.querySelector('#messages .msg.assistant:last-child').textContent.length > 0")
        assert page.is_enabled("#stop") and not page.is_enabled("#send")
        page.click("#stop")
        page.wait_for_selector('#stats[data-state="stopped"]')
        _until(lambda: aengine.num_in_flight() == 0, "the server to drop the stopped request")
    after = _until(lambda: (m := _scrape(url))["tokenmill:num_requests_running"] == 0 and m, "running back to 0")
    abort = "tokenmill:request_success_total|finished_reason=abort"
    assert after[abort] == before[abort] + 1
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    assert _last_answer(page)  # the partial answer stays on the page
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    page.screenshot(path=str(shots / "stopped.png"))
    page.context.close()


@needs_browser
def test_json_schema_mode(browser, served):
    url = served.url
    page = _open(browser, url)
    _settings(page, max_tokens=64)
    page.check("#json-mode")
    # compact JSON: a random model would otherwise write whitespace until max_tokens
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False},
    }
    page.fill("#json-schema", json.dumps(schema))
    with page.expect_request("**/v1/chat/completions") as sent:
        _send(page, "Answer in JSON")
    assert sent.value.post_data_json["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
    page.wait_for_selector('#stats[data-state="done"]')
    assert "valid JSON" in page.text_content("#stats")
    assert set(json.loads(_last_answer(page))) == {"ok"}
    page.fill("#json-schema", "{not json")  # refused on the page, nothing sent
    _send(page, "again")
    page.wait_for_selector('#stats[data-state="error"]')
    assert "JSON schema" in page.text_content("#stats")
    page.context.close()


@needs_browser
def test_dashboard_moves_under_load(browser, served, shots):
    url, aengine = served.url, served.aengine
    n, max_tokens = 6, 48
    page = _open(browser, url, view="dashboard")
    model = page.input_value("#model")
    page.wait_for_selector("#tile-finished")
    finished = _tile(page, "finished")

    def one(i):
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return client.chat.completions.create(
                model=model,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"request {i}"}],
            )

    def all_running(_outputs):
        return len(aengine.engine.core.scheduler.running) == n

    sched = aengine.engine.core.scheduler
    with ThreadPoolExecutor(n) as pool, Hold(aengine, bool) as first, Hold(aengine, all_running) as hold:
        futures = [pool.submit(one, i) for i in range(n)]
        assert first.reached.wait(60)  # the engine waits at its first output until every request is queued,
        _until(lambda: len(sched.requests) + aengine._inbox.qsize() == n, "all requests queued")
        first.release.set()  # so that all of them run together before any can finish
        assert hold.reached.wait(60)
        # the engine is held with all of them running: the dashboard must come to show it
        page.wait_for_function(f"document.querySelector('#tile-running').dataset.value == '{n}'")
        assert _tile(page, "kv") > 0
        hold.release.set()
        assert [f.result().usage.completion_tokens for f in futures] == [max_tokens] * n
    page.wait_for_function(f"Number(document.querySelector('#tile-finished').dataset.value) >= {finished + n}")
    page.wait_for_function("document.querySelector('#tile-running').dataset.value == '0'")
    page.wait_for_function(f"Number(document.querySelector('#lat-ttft').dataset.count) >= {n}")
    assert int(page.get_attribute("#lat-itl", "data-count")) >= n * (max_tokens - 1)
    assert page.locator("#chart-tokens path.line").count() >= 1  # throughput drawn
    assert page.locator("#tile-spec").count() == 0  # no speculative decoding on this server
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
    page.context.close()


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' rule, over cumulative (upper bound, count) buckets sorted by bound."""
    rank = q * buckets[-1][1]
    prev_le = prev_n = 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


@needs_browser
def test_dashboard_reads_metrics_as_prometheus_does(browser, served):
    url = served.url
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        for i in range(3):  # a few observations in every histogram
            client.completions.create(
                model=model, prompt=f"Hello {i}", max_tokens=8 + i, extra_body={"ignore_eos": True}
            )
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    page = _open(browser, url)
    got = page.evaluate(
        """async (text) => {
        const prom = await import(new URL("ui/prom.js", location.href));
        const s = prom.parse(text);
        const q = (name) => [0.5, 0.9, 0.99].map((p) => prom.quantile(p, prom.buckets(s, name)));
        return {ttft: q("time_to_first_token_seconds"), itl: q("inter_token_latency_seconds"),
                gen: prom.total(s, "generation_tokens_total"),
                length: prom.total(s, "request_success_total", {finished_reason: "length"})};
    }""",
        text,
    )
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for key, name in (
        ("ttft", "tokenmill:time_to_first_token_seconds"),
        ("itl", "tokenmill:inter_token_latency_seconds"),
    ):
        buckets = [(float(s.labels["le"]), s.value) for s in fams[name].samples if s.name.endswith("_bucket")]
        want = [_histogram_quantile(q, sorted(buckets)) for q in (0.5, 0.9, 0.99)]
        assert got[key] == pytest.approx(want), key
    want = _scrape_text(text)
    assert got["gen"] == want["tokenmill:generation_tokens_total"]
    assert got["length"] == want["tokenmill:request_success_total|finished_reason=length"] >= 3
    page.context.close()


# ---- the README's screenshots (on demand) ---------------------------------------------------------
@needs_browser
@pytest.mark.skipif(not os.environ.get(SHOTS_ENV), reason=f"{SHOTS_ENV}=docs/img retakes the README's screenshots")
@pytest.mark.timeout(1500)
def test_readme_screenshots(browser, smollm2_dir):
    """The playground answering on SmolLM2; the dashboard while 8 chat users keep it busy."""
    out = Path(os.environ[SHOTS_ENV])
    out.mkdir(parents=True, exist_ok=True)
    name = "SmolLM2-135M-Instruct"
    with running_server(smollm2_dir, dtype="bfloat16", kv_cache_memory=0.5, served_model_name=name) as (server, _):
        page = _open(browser, server.url, key=None)
        page.fill("#system", "You are a helpful assistant.")
        _settings(page, max_tokens=200, temperature=0.7)
        page.fill("#seed", "1")
        _send(page, "Write a haiku about paged attention.")
        page.wait_for_selector('#stats[data-state="done"]', timeout=300_000)
        page.screenshot(path=str(out / "playground.png"))

        dash = _open(browser, server.url, view="dashboard", key=None)
        system = "You are a helpful assistant. Answer in two or three sentences."
        topics = ["the sea", "compilers", "KV caches", "bread", "trains", "owls", "tea", "rust", "jazz", "maps"]
        done = threading.Event()

        def user(i):
            with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
                while not done.is_set():
                    c.chat.completions.create(
                        model=name,
                        max_tokens=32 + 16 * (i % 4),
                        temperature=0.8,
                        messages=[
                            {"role": "system", "content": system},
                            {"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."},
                        ],
                    )

        busy = (
            "Number(document.querySelector('#tile-finished')?.dataset.value) >= 30 && "
            "Number(document.querySelector('#tile-running').dataset.value) > 0"
        )
        with ThreadPoolExecutor(8) as pool:
            users = [pool.submit(user, i) for i in range(8)]
            try:  # under load for a while: some 30 requests done, some running
                _until(lambda: any(u.done() for u in users) or dash.evaluate(busy), "a busy dashboard", 1000)
                dash.screenshot(path=str(out / "dashboard.png"), full_page=True)
            finally:
                done.set()
            for u in users:
                u.result()  # a user's error, if any
