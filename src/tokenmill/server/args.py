"""ServerArgs: every `tokenmill serve` server flag, defined once. Its fields become the flags (as
EngineArgs' do: `--field-name`, the help and argparse details in each field's metadata);
`serve()`, `build_app()` and the ServerContext take one, and so does the Ray Serve ingress
(which reads the fields of RAY_INGRESS_FIELDS; the rest are the HTTP listener's, Ray Serve's
proxy's there). Light: no torch, no FastAPI (the CLI builds its parser from it)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from tokenmill import envs

DEFAULT_MAX_BODY_BYTES = 2_000_000  # TGI's --payload-limit default
DEFAULT_MAX_PROMPTS = 256  # prompts in one /v1/completions request (--max-prompts-per-request)
# Values (tokens, logprob entries, embedding numbers) one non-streamed response may hold
# (--max-response-values; response_body.py): such a response is built whole in memory.
DEFAULT_MAX_RESPONSE_VALUES = 4_000_000
DEFAULT_MAX_STORED = 1000  # responses the Responses API keeps (--max-stored-responses)
DEFAULT_METRICS_PREFIX = "tokenmill"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _flag(default: Any, help: str, repr: bool = True, **argparse_kw: Any) -> Any:
    """A field that is a flag: its default, help, and any other add_argument keywords (choices,
    metavar; cli_default: a function giving the flag's default when the parser is built)."""
    return field(default=default, repr=repr, metadata={"help": help, **argparse_kw})


@dataclass
class ServerArgs:
    """The HTTP server's settings (`tokenmill serve`'s server flags)."""

    host: str = _flag("0.0.0.0", "address to listen on (default: all interfaces, 0.0.0.0)")
    port: int = _flag(8000, "port to listen on (default 8000)")
    api_key: str | None = _flag(
        None,
        "require 'Authorization: Bearer <key>' on every route but /health and the API docs "
        "(default: $TOKENMILL_API_KEY; none: no authentication)",
        repr=False,
        cli_default=lambda: envs.TOKENMILL_API_KEY,
    )
    max_waiting: int | None = _flag(
        None, "refuse new requests with 503 + Retry-After while this many wait for the engine (default: no limit)"
    )
    drain_timeout: float = _flag(
        30.0,
        "on SIGTERM / SIGINT, seconds to let in-flight requests finish before they are aborted; then the "
        "server exits 0 (default 30)",
    )
    max_logprobs: int = _flag(20, "largest logprobs / top_logprobs a request may ask for (default 20)")
    chat_template: str | None = _flag(
        None, "Jinja chat template (a file path or the template itself) instead of the model's"
    )
    trust_request_chat_template: bool = _flag(
        False,
        "accept a chat_template sent in a request (default: refused with 400; a template is a program the server runs)",
    )
    max_request_body_bytes: int = _flag(
        DEFAULT_MAX_BODY_BYTES,
        "refuse larger request bodies with 413 (default 2000000, as TGI's --payload-limit; 0: no limit)",
    )
    max_prompts_per_request: int = _flag(
        DEFAULT_MAX_PROMPTS, "most prompts one /v1/completions request may carry (default 256)"
    )
    max_response_values: int = _flag(
        DEFAULT_MAX_RESPONSE_VALUES,
        "refuse with 400 a non-streamed request whose response could hold more values than this: tokens of text, "
        "logprob entries (each token's and its top ones) and embedding numbers, counted from n, max_tokens, "
        "logprobs and the inputs (default 4000000; 0: no limit; streamed responses are not counted)",
    )
    max_stored_responses: int = _flag(
        DEFAULT_MAX_STORED,
        "Responses API: responses kept in memory for GET /v1/responses/{id} and "
        "previous_response_id, least recently used dropped first (default 1000; 0: none)",
    )
    disable_log_requests: bool = _flag(
        False, "do not write the access-log line of each request (id, tokens in/out, TTFT, latency)"
    )
    disable_web_ui: bool = _flag(
        False,
        "do not serve the web playground and live dashboard at / (its data calls need --api-key like every route)",
    )
    uvicorn_log_level: str = _flag(
        "info", "log level of uvicorn's own messages (default info)", choices=list(UVICORN_LOG_LEVELS)
    )
    timeout_keep_alive: int = _flag(5, "seconds an idle keep-alive connection stays open (default 5)")
    ssl_keyfile: str | None = _flag(None, "TLS private key file (serve HTTPS)")
    ssl_certfile: str | None = _flag(None, "TLS certificate file (serve HTTPS)")
    root_path: str = _flag("", "ASGI root_path, when behind a path-based proxy")
    otlp_traces_endpoint: str | None = _flag(
        None,
        "send one OpenTelemetry span per request (vLLM's GenAI attributes) to this OTLP collector URL, e.g. "
        "http://localhost:4318/v1/traces (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
        "$OTEL_EXPORTER_OTLP_ENDPOINT if set, else off); pip install 'tokenmill[otel]'",
    )
    metrics_prefix: str = _flag(
        DEFAULT_METRICS_PREFIX,
        "prefix of the /metrics names: tokenmill (tokenmill:*) or vllm (vllm:*, so "
        "dashboards made for vLLM work unchanged) (default: tokenmill)",
    )

    @property
    def log_requests(self) -> bool:
        return not self.disable_log_requests

    @property
    def body_limit(self) -> int | None:
        """The request body limit in bytes, None for none (--max-request-body-bytes 0)."""
        return self.max_request_body_bytes or None

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field, in the "server" group."""
        g = parser.add_argument_group("server")
        for f in fields(ServerArgs):
            kw = dict(f.metadata)
            cli_default = kw.pop("cli_default", None)
            kw["default"] = cli_default() if cli_default is not None else f.default
            if f.type in ("bool", bool):
                kw["action"] = "store_true"
            elif _TYPES[str(f.type)] is not None:
                kw["type"] = _TYPES[str(f.type)]
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)

    def with_chat_template_file(self) -> ServerArgs:
        """A copy whose chat_template holds the template itself when it named a file."""
        if self.chat_template and os.path.isfile(self.chat_template):
            with open(self.chat_template, encoding="utf-8") as f:
                return dataclasses.replace(self, chat_template=f.read())
        return self


_TYPES = {"str": None, "str | None": None, "int": int, "int | None": int, "float": float, "float | None": float}

# The fields that apply behind Ray Serve's proxy (the ingress deployment). The others are the
# listener's (host, port, TLS, ...: Ray Serve's HTTP options, ClusterOptions), the engine's
# (max_waiting, drain_timeout: ReplicaOptions), or not supported there yet (tracing, metrics_prefix).
RAY_INGRESS_FIELDS = (
    "api_key",
    "max_logprobs",
    "chat_template",
    "trust_request_chat_template",
    "max_request_body_bytes",
    "max_prompts_per_request",
    "max_response_values",
    "max_stored_responses",
    "disable_log_requests",
    "disable_web_ui",
)
