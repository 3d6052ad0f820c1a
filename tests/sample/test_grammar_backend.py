"""The structured-output backend is built before the first grammar request needs it, off the engine
thread and the event loop, and the grammar step imports nothing heavy (a server's first grammar
request used to stall every stream for ~9 s: `import llguidance.torch` and the grammar vocabulary)."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
from conftest import running_server

from tokenmill.sample.structured_output import StructuredOutputManager

CHILD = """
import sys
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import GuidedDecodingParams

llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=0.02)
params = SamplingParams(max_tokens=6, temperature=0, guided_decoding=GuidedDecodingParams(regex="[ab]+c"))
text = llm.generate(["Hello"], params)[0].outputs[0].text
heavy = [m for m in ("llguidance.torch", "torch._dynamo", "torch._inductor") if m in sys.modules]
print("TEXT", repr(text), "HEAVY", heavy)
"""


def test_a_grammar_step_imports_neither_llguidance_torch_nor_dynamo(tiny_llama_dir):
    """llguidance.torch imports torch._dynamo and inductor (~4 s, on the engine thread at the first
    grammar step): masks are filled without it. A fresh process, so that no other test's imports count."""
    r = subprocess.run([sys.executable, "-c", CHILD, tiny_llama_dir], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("TEXT"))
    assert line.endswith("HEAVY []"), line
    text = eval(line.split(" ", 1)[1].rsplit(" HEAVY", 1)[0])  # noqa: S307 - our own child's repr
    assert text.rstrip("c").strip("ab") == "" and text, text


def test_server_builds_the_backend_in_the_background_and_a_grammar_request_waits_for_it(tiny_llama_dir, monkeypatch):
    """The server starts the build once it is ready, on a thread of its own. Held there, a grammar
    request waits for it without reaching the engine, while plain requests (the engine thread) and
    the event loop carry on; released, the grammar request is served."""
    release, building = threading.Event(), threading.Event()
    builds, enqueued = [], []
    build = StructuredOutputManager._build

    def held_build(self) -> None:
        building.set()
        assert release.wait(120), "the test never released the build"
        builds.append(threading.current_thread().name)
        build(self)

    monkeypatch.setattr(StructuredOutputManager, "_build", held_build)
    with running_server(tiny_llama_dir) as (server, aengine):
        so, engine = aengine.engine.structured_output, aengine.engine
        enqueue = engine.enqueue

        def spy(req):  # runs on the engine thread: what the backend was like when a request got there
            enqueued.append((req.matcher is not None, so.initialised.is_set()))
            return enqueue(req)

        monkeypatch.setattr(engine, "enqueue", spy)
        assert building.wait(60), "no build started without a grammar request"
        with httpx.Client(base_url=server.url, timeout=120) as http:
            answer: list[httpx.Response] = []
            grammar = threading.Thread(
                target=lambda: answer.append(
                    http.post(
                        "/v1/completions",
                        json={"prompt": "Hi", "max_tokens": 6, "temperature": 0, "guided_regex": "[ab]+c"},
                    )
                )
            )
            grammar.start()
            try:
                plain = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
                assert plain.status_code == 200, plain.text
                assert http.get("/health").status_code == 200
                assert grammar.is_alive() and not answer  # still waiting for the backend
                assert enqueued == [(False, False)]  # only the plain request reached the engine
            finally:
                release.set()
                grammar.join(120)
            assert answer and answer[0].status_code == 200, answer and answer[0].text
            assert answer[0].json()["choices"][0]["text"].rstrip("c").strip("ab") == ""
        assert builds == ["tokenmill-grammar-init"]  # once, on its own thread
        assert enqueued[-1] == (True, True)
