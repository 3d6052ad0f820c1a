"""OpenTelemetry tracing end to end: `tokenmill serve --otlp-traces-endpoint` (a subprocess, as users
run it) exports one SERVER span per request over OTLP/HTTP, batched and flushed when SIGTERM stops
it, to a real receiver started here on loopback, which decodes the protobuf ExportTraceServiceRequest
with opentelemetry-proto's classes. The spans carry vLLM's GenAI attributes and are children of the
traceparent each request sent. The same server checks the wiring of --scheduling-policy priority and
--metrics-prefix vllm."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
from conftest import free_port
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tokenmill.server import tracing

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
TRACE_ID2, PARENT_ID2 = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACESTATE = "congo=t61rcWkgMzE"


class OTLPReceiver:
    """A minimal OTLP/HTTP collector: POST /v1/traces with a protobuf body; keeps every span."""

    def __init__(self):
        self.spans: list[tuple[dict, Span]] = []  # (resource attributes, span)
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.changed:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                self.spans += [(resource, span) for ss in rs.scope_spans for span in ss.spans]
            self.changed.notify_all()

    def wait_for(self, n: int, timeout: float = 60.0) -> list[tuple[dict, Span]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.spans) >= n, timeout), f"{len(self.spans)} spans of {n}"
            return list(self.spans)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attrs(span: Span) -> dict:
    return {a.key: _value(a.value) for a in span.attributes}


def test_one_server_span_per_request_child_of_the_callers_trace(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A batch delay of 10 minutes: spans leave only with the flush at shutdown (or a full batch of 512).
    env = {**os.environ, "OTEL_SERVICE_NAME": "tokenmill-test", "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    with OTLPReceiver() as receiver, open(log_path, "w+") as log:
        cmd = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            tiny_llama_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "0.05",
            "--served-model-name",
            "tiny",
            "--otlp-traces-endpoint",
            receiver.url + "/v1/traces",
            "--scheduling-policy",
            "priority",
            "--metrics-prefix",
            "vllm",
        ]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 300
            while True:  # bounded: the model loads in the subprocess
                assert proc.poll() is None, log_path.read_text()
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
            with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
                chat = client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "Hello there"}],
                    max_tokens=5,
                    temperature=0.5,
                    top_p=0.9,
                    extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": TRACESTATE},
                    extra_body={"priority": 3, "ignore_eos": True},
                )  # accepted: --scheduling-policy priority
                chunks = list(
                    client.completions.create(
                        model="tiny",
                        prompt="The quick brown fox",
                        max_tokens=4,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_headers={"traceparent": f"00-{TRACE_ID2}-{PARENT_ID2}-01"},
                    )
                )
                root = client.completions.create(model="tiny", prompt="No trace context", max_tokens=2)
            metrics = httpx.get(url + "/metrics").text  # --metrics-prefix vllm reached the server
            assert 'vllm:num_requests_running{model_name="tiny"}' in metrics and "tokenmill:" not in metrics
            assert not receiver.spans  # batched: nothing exported on the requests' path
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        spans = {_attrs(s)["gen_ai.request.id"]: (res, s) for res, s in receiver.wait_for(3, timeout=5)}
    cmpl_id, cmpl_usage = chunks[0].id, chunks[-1].usage
    assert set(spans) == {chat.id, cmpl_id, root.id}  # one per request, flushed at shutdown

    resource, span = spans[chat.id]
    assert resource["service.name"] == "tokenmill-test"  # OTEL_SERVICE_NAME
    assert span.name == "llm_request" and span.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert span.trace_state == TRACESTATE
    a = _attrs(span)
    assert a["gen_ai.response.model"] == "tiny"
    assert a["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == chat.usage.completion_tokens == 5
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    e2e = a["gen_ai.latency.e2e"]
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= e2e and 0 <= a["gen_ai.latency.time_in_queue"] <= e2e
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        a["gen_ai.latency.time_in_model_inference"], abs=1e-6
    )
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e, abs=1e-3)
    assert abs(span.start_time_unix_nano / 1e9 - time.time()) < 3600  # wall-clock time, not monotonic

    _, span = spans[cmpl_id]
    assert span.trace_id.hex() == TRACE_ID2 and span.parent_span_id.hex() == PARENT_ID2 and not span.trace_state
    a = _attrs(span)
    assert a["gen_ai.usage.completion_tokens"] == cmpl_usage.completion_tokens
    assert a["gen_ai.usage.prompt_tokens"] == cmpl_usage.prompt_tokens
    assert a["gen_ai.request.temperature"] == 0.0

    _, span = spans[root.id]
    assert not span.parent_span_id and span.trace_id.hex() not in (TRACE_ID, TRACE_ID2)  # a trace of its own
    assert "OpenTelemetry: one span per request, exported to " + receiver.url in log_path.read_text()


def test_configuration(monkeypatch):
    for var in (
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_SDK_DISABLED",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(var, raising=False)
    assert not tracing.tracing_requested(None)
    assert tracing.tracing_requested("http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing.tracing_requested(None)
    t = tracing.RequestTracer()  # the exporter reads the variables itself: the standard signal path
    assert t.endpoint == "http://collector:4318/v1/traces"
    t.shutdown()
    t = tracing.RequestTracer("http://other:4318")  # the flag wins; a bare URL gets /v1/traces
    assert t.endpoint == "http://other:4318/v1/traces"
    t.shutdown()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.tracing_requested("http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="unsupported OTLP protocol"):
        tracing.RequestTracer("http://collector:4318/v1/traces")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:  # grpc:// asks for gRPC, which needs its own exporter package
        with pytest.raises(ValueError, match="opentelemetry-exporter-otlp-proto-grpc"):
            tracing.RequestTracer("grpc://collector:4317")
