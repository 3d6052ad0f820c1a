"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one SERVER span per engine request,
named `llm_request` and carrying the GenAI attributes vLLM sets (vllm/tracing.py's SpanAttributes).

The engine thread only records timestamps (RequestMetrics, as it does for the metrics); the span is
built on the event loop once a request's last output arrives, with explicit start and end times,
and handed to the SDK's BatchSpanProcessor, whose own thread batches and exports it. The caller's
W3C `traceparent` / `tracestate` headers make the span a child of the caller's trace. Without
tracing nothing here runs: the server keeps `tracer = None` and this module imports no OpenTelemetry.

Configuration is OpenTelemetry's own: the exporters read OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT,
_HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE; the batch processor OTEL_BSP_*; the resource
OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the sampler OTEL_TRACES_SAMPLER (default: follow the
caller's sampled flag). Protocol: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, `http/protobuf` (default)
or `grpc` (also picked by a grpc:// endpoint; needs opentelemetry-exporter-otlp-proto-grpc).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from urllib.parse import urlparse

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.server")

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"  # vLLM's
DEFAULT_SERVICE_NAME = "tokenmill"
INSTALL_HINT = "pip install 'tokenmill[otel]'"


class SpanAttributes:
    """vLLM's attribute names (the OpenTelemetry GenAI semantic conventions, plus its own latencies)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace context headers of an incoming request (empty when it sent none)."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def tracing_requested(endpoint: str | None) -> bool:
    """Tracing is on with --otlp-traces-endpoint, or with OpenTelemetry's endpoint variables set
    (unless OTEL_SDK_DISABLED=true)."""
    if (_env("OTEL_SDK_DISABLED") or "").lower() == "true":
        return False
    return bool(endpoint) or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT") is not None


def _protocol(endpoint: str | None) -> str:
    chosen = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    if chosen:
        return chosen
    url = endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT") or ""
    return "grpc" if url.startswith("grpc://") else "http/protobuf"


def _exporter(endpoint: str | None):
    """The OTLP span exporter for the configured protocol; `endpoint` None: the exporter's own
    reading of the environment. An OTLP/HTTP URL without a path gets the standard /v1/traces."""
    protocol = _protocol(endpoint)
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"unsupported OTLP protocol {protocol!r}: use http/protobuf or grpc")
    except ImportError as e:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise ValueError(
            f"OTLP tracing over {protocol} needs {package} ({e}); "
            f"{INSTALL_HINT}" + (f" and pip install {package}" if protocol == "grpc" else "")
        ) from None
    if endpoint and protocol == "http/protobuf" and urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint or None)


class RequestTracer:
    """Turns finished requests into spans and exports them in batches (BatchSpanProcessor)."""

    def __init__(self, endpoint: str | None = None):
        try:
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK ({e}): {INSTALL_HINT}") from None
        import tokenmill

        resource = Resource.create({"service.version": tokenmill.__version__})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # no OTEL_SERVICE_NAME
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.exporter = _exporter(endpoint)
        # One provider per server, not the process-wide global: several servers may share a process.
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tokenmill.server", tokenmill.__version__)
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

    @property
    def endpoint(self) -> str:
        return str(getattr(self.exporter, "_endpoint", ""))

    def record(
        self, out: RequestOutput, params: SamplingParams, model: str, headers: dict[str, str] | None = None
    ) -> None:
        """The span of a finished request, from the engine's timestamps (monotonic, turned into
        wall-clock nanoseconds); a child of the caller's trace when `headers` carry one. Never
        raises: tracing must not fail a request."""
        try:
            self._record(out, params, model, headers)
        except Exception:  # noqa: BLE001
            logger.exception("could not record the span of request %s", out.request_id)

    def _record(self, out: RequestOutput, params: SamplingParams, model: str, headers: dict[str, str] | None) -> None:
        m = out.metrics
        if m is None:
            return
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        wall = time.time_ns() - time.monotonic_ns()
        completion = out.outputs[0]
        a = SpanAttributes
        attrs: dict = {
            a.GEN_AI_REQUEST_ID: out.request_id,
            a.GEN_AI_RESPONSE_MODEL: model,
            a.GEN_AI_USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
            a.GEN_AI_USAGE_COMPLETION_TOKENS: len(completion.token_ids),
            a.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            a.GEN_AI_REQUEST_TOP_P: params.top_p,
            a.GEN_AI_REQUEST_N: params.n,
            a.GEN_AI_LATENCY_E2E: end - m.arrival_time,
        }
        if params.max_tokens is not None:
            attrs[a.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        if completion.finish_reason:
            attrs[a.GEN_AI_RESPONSE_FINISH_REASONS] = [completion.finish_reason]
        if m.first_scheduled_time is not None:
            attrs[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = m.first_scheduled_time - m.arrival_time
            attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = end - m.first_scheduled_time
        if m.first_token_time is not None:
            attrs[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = m.first_token_time - m.arrival_time
            attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = end - m.first_token_time
            if m.first_scheduled_time is not None:
                attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = m.first_token_time - m.first_scheduled_time
        parent = self._propagator.extract(headers) if headers else None
        span = self.tracer.start_span(
            SPAN_NAME, context=parent, kind=self._kind, attributes=attrs, start_time=int(m.arrival_time * 1e9) + wall
        )
        span.end(end_time=int(end * 1e9) + wall)

    def shutdown(self) -> None:
        """Export what is still batched, then stop the exporter's thread."""
        self.provider.shutdown()
