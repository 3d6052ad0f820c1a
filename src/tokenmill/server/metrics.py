"""Prometheus metrics, named `tokenmill:*` like vLLM's `vllm:*` (`--metrics-prefix vllm`: named
`vllm:*`, so dashboards built for vLLM read them unchanged; README lists the differences).

Per-token and per-request numbers are taken on the engine thread after each step (a step
observer), from the engine's own timestamps; queue and cache gauges are read when scraped.
Each server has its own registry, so several servers can live in one process (tests).

With --enable-lora, the request counters (prompt and generation tokens, finished requests) carry
a `lora_name` label ("" for the base model), and `tokenmill:lora_requests_info` says which
adapters the running and waiting requests use, as vLLM's `vllm:lora_requests_info`.
"""

from __future__ import annotations

import re
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.server.args import DEFAULT_METRICS_PREFIX

# No `*_created` series next to every counter and histogram (vLLM drops them too).
prometheus_client.disable_created_metrics()

# vLLM's buckets.
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
REQUEST_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


def check_metrics_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
        raise ValueError(f"--metrics-prefix must be letters, digits and _ (not starting with a digit), got {prefix!r}")
    return prefix


def token_count_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to the context length: 1, 2, 5, 10, 20, 50, ..."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineGauges:
    """Gauges read at scrape time: always current, even when the engine is idle."""

    def __init__(self, aengine: AsyncLLMEngine, model_name: str, prefix: str = DEFAULT_METRICS_PREFIX):
        self.aengine = aengine
        self.model_name = model_name
        self.prefix = prefix

    def collect(self):
        core = self.aengine.engine.core
        labels = [self.model_name]
        p = self.prefix
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", len(core.scheduler.running)),
            (
                "num_requests_waiting",
                "Requests waiting to be scheduled (preempted ones included).",
                len(core.scheduler.waiting),
            ),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", core.kv.usage()),
        ):
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric(labels, float(value))
            yield g
        stats = core.kv.stats  # cumulative, kept by the KV cache manager on the engine thread
        for name, doc, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.queries),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.hits),
        ):
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric(labels, float(value))
            yield c
        g = GaugeMetricFamily(
            f"{p}:prefix_cache_hit_rate", "Prefix cache hits / queries since start.", labels=["model_name"]
        )
        g.add_metric(labels, stats.hit_rate)
        yield g
        if core.drafter is not None:
            yield from _spec_decode_counters(core.drafter.stats, labels, p)
        lora = getattr(self.aengine.engine.config, "lora", None)
        if lora is not None:
            yield _lora_info(core.scheduler, lora.max_loras, p)


def _lora_info(scheduler, max_loras: int, prefix: str) -> GaugeMetricFamily:
    """vLLM's lora_requests_info: the adapters of the running and of the waiting requests (names,
    comma-joined) as labels; the value is the time of the scrape."""

    def names(requests) -> str:
        return ",".join(sorted({r.lora.name for r in requests if r.lora is not None}))

    running, waiting = list(scheduler.running), list(scheduler.waiting)  # copies: the engine thread owns them
    g = GaugeMetricFamily(
        f"{prefix}:lora_requests_info",
        "Running stats on LoRA requests (the value: the time of the scrape).",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    g.add_metric([str(max_loras), names(running), names(waiting)], time.time())
    return g


def _spec_decode_counters(st, labels: list[str], prefix: str):
    """vLLM's speculative-decoding counters (each exposed with the _total suffix)."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Verification steps x requests that carried draft tokens.", st.num_drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", st.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", st.num_accepted_tokens),
    ):
        c = CounterMetricFamily(f"{prefix}:{name}", doc, labels=["model_name"])
        c.add_metric(labels, float(value))
        yield c
    c = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["model_name", "position"],
    )
    for pos, n in enumerate(st.accepted_per_pos):
        c.add_metric(labels + [str(pos)], float(n))
    yield c


class ServerMetrics:
    def __init__(self, aengine: AsyncLLMEngine, model_name: str, prefix: str = DEFAULT_METRICS_PREFIX):
        check_metrics_prefix(prefix)
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg, lab, p = self.registry, ["model_name"], prefix
        # --enable-lora: the request counters by adapter too (lora_name; "" for the base model)
        self.lora = getattr(aengine.engine.config, "lora", None) is not None
        req_lab = lab + ["lora_name"] if self.lora else lab
        self._lora_of: dict[str, str] = {}  # request id -> adapter name, for requests with an adapter
        self._prompt_tokens = Counter(
            f"{p}:prompt_tokens", "Prompt tokens processed (once per request).", req_lab, registry=reg
        )
        self._generation_tokens = Counter(f"{p}:generation_tokens", "Tokens generated.", req_lab, registry=reg)
        self.prompt_tokens = self._prompt_tokens.labels(*self._labels(""))
        self.generation_tokens = self._generation_tokens.labels(*self._labels(""))
        self.preemptions = Counter(
            f"{p}:num_preemptions", "Requests preempted (KV blocks freed, recomputed).", lab, registry=reg
        ).labels(model_name)
        self.request_success = Counter(
            f"{p}:request_success", "Requests finished, by finish reason.", req_lab + ["finished_reason"], registry=reg
        )

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{p}:{name}", doc, lab, buckets=buckets, registry=reg).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first being scheduled.", REQUEST_LATENCY_BUCKETS
        )
        # Per finished request, as vLLM's (its Grafana dashboard draws them).
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first scheduled to the first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "Time from first scheduled to the last token.", REQUEST_LATENCY_BUCKETS
        )
        token_buckets = token_count_buckets(aengine.engine.config.model.max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of each finished request.", token_buckets
        )
        for reason in ("stop", "length", "abort"):  # present from the start, as vLLM does
            self.request_success.labels(*self._labels(""), reason)
        reg.register(_EngineGauges(aengine, model_name, prefix))
        self._engine = aengine.engine
        self._last_token_time: dict[str, float] = {}  # engine thread only
        self._preemptions_seen = self._engine.core.scheduler.num_preemptions
        aengine.step_observers.append(self.on_step)

    def _labels(self, lora_name: str) -> tuple[str, ...]:
        return (self.model_name, lora_name) if self.lora else (self.model_name,)

    # event loop
    def set_lora(self, request_id: str, lora_name: str) -> None:
        """The adapter of a request about to be added (its counters get lora_name); forgotten when it
        finishes, is aborted (on_abort) or is refused (forget)."""
        self._lora_of[request_id] = lora_name

    def forget(self, request_id: str) -> None:
        self._lora_of.pop(request_id, None)

    # engine thread
    def on_step(self, outputs: list[RequestOutput], step_seconds: float) -> None:
        now = time.monotonic()
        last_times = self._last_token_time
        lora_of = self._lora_of
        for out in outputs:
            if isinstance(out, PoolingRequestOutput):  # an embedding: its prompt ran, nothing was generated
                self._on_pooled(out)
                continue
            rid = out.request_id
            lora_name = lora_of.get(rid) if lora_of else None
            n_new = len(out.outputs[0].delta_token_ids)
            if n_new:
                if lora_name is None:
                    self.generation_tokens.inc(n_new)
                else:
                    self._generation_tokens.labels(self.model_name, lora_name).inc(n_new)
            m = out.metrics
            last = last_times.get(rid)
            if last is None:  # the request's first output
                if lora_name is None:
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    self._prompt_tokens.labels(self.model_name, lora_name).inc(len(out.prompt_token_ids))
                if m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                if m is not None and m.first_scheduled_time is not None:
                    self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            elif n_new:
                gap = (now - last) / n_new
                for _ in range(n_new):
                    self.itl.observe(gap)
            if out.finished:
                last_times.pop(rid, None)
                if m is not None and m.finished_time is not None:
                    self._observe_finished(out, m)
                if lora_name is not None:
                    lora_of.pop(rid, None)
                reason = out.outputs[0].finish_reason or "abort"
                self.request_success.labels(*self._labels(lora_name or ""), reason).inc()
            else:
                last_times[rid] = now
        sched = self._engine.core.scheduler
        if sched.num_preemptions != self._preemptions_seen:
            self.preemptions.inc(sched.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = sched.num_preemptions
        if len(last_times) > len(sched.requests):  # aborted requests never send a last output
            for rid in [r for r in last_times if r not in sched.requests]:
                del last_times[rid]

    def _on_pooled(self, out: PoolingRequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.request_success.labels(*self._labels(""), "stop").inc()

    def _observe_finished(self, out: RequestOutput, m) -> None:
        end = m.finished_time
        self.e2e.observe(end - m.arrival_time)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(len(out.outputs[0].token_ids))
        if m.first_scheduled_time is not None:
            self.inference_time.observe(end - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.decode_time.observe(end - m.first_token_time)

    # event loop
    def on_abort(self, request_id: str | None = None) -> None:
        """A request closed by its client (disconnect) before it finished (`request_id`: one with an
        adapter, counted under its lora_name)."""
        lora_name = self._lora_of.pop(request_id, "") if request_id is not None else ""
        self.request_success.labels(*self._labels(lora_name), "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
