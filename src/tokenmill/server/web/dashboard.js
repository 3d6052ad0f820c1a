// The live dashboard: /metrics scraped every second; rates and percentiles are taken between
// scrapes the page keeps (the last WINDOW seconds), the way Prometheus' rate() and
// histogram_quantile() would over the same series.

import { call } from "./api.js";
import { drawChart, fmt } from "./chart.js";
import { bucketDelta, buckets, mean, parse, quantile, total } from "./prom.js";

const INTERVAL_MS = 1000;
const WINDOW = 300; // seconds of history kept; the charts span it, or the page's age (1 minute at least)
const RATE_SPAN = 5; // seconds over which tokens/s is taken (tiles and chart)
const LATENCY_SPAN = 60; // seconds of the latency percentiles
const HISTOGRAMS = {
  ttft: ["time_to_first_token_seconds", "Time to first token"],
  itl: ["inter_token_latency_seconds", "Inter-token latency"],
  e2e: ["e2e_request_latency_seconds", "End-to-end latency"],
  queue: ["request_queue_time_seconds", "Queue time"],
};
const COLORS = { a: "#2563eb", b: "#e8590c", c: "#2f9e44", d: "#ae3ec9" };

const samples = [];
let visible = false;

function snapshot(text) {
  const s = parse(text);
  const snap = {
    t: performance.now() / 1000,
    running: total(s, "num_requests_running"),
    waiting: total(s, "num_requests_waiting"),
    kv: mean(s, "kv_cache_usage_perc"), // a fraction: averaged over replicas
    queries: total(s, "prefix_cache_queries_total"),
    hits: total(s, "prefix_cache_hits_total"),
    prompt: total(s, "prompt_tokens_total"),
    gen: total(s, "generation_tokens_total"),
    preempt: total(s, "num_preemptions_total"),
    drafts: total(s, "spec_decode_num_draft_tokens_total"),
    accepted: total(s, "spec_decode_num_accepted_tokens_total"),
    finished: {},
  };
  for (const r of s.get("request_success_total") || []) {
    const reason = r.labels.finished_reason;
    snap.finished[reason] = (snap.finished[reason] || 0) + r.value;
  }
  for (const [key, [name]] of Object.entries(HISTOGRAMS)) snap[key] = buckets(s, name);
  return snap;
}

// The newest sample at least `span` seconds older than `now` (else the oldest one).
function before(now, span) {
  let found = samples[0];
  for (const s of samples) {
    if (now.t - s.t >= span) found = s;
    else break;
  }
  return found === now ? null : found;
}

function rate(now, old, key) {
  if (!old || now[key] == null || old[key] == null) return null;
  return Math.max(0, now[key] - old[key]) / (now.t - old.t);
}

function percentiles(now, key, span) {
  const d = bucketDelta(now[key], before(now, span)?.[key]);
  const count = d.length ? d[d.length - 1][1] : 0;
  return { count, p50: quantile(0.5, d), p90: quantile(0.9, d), p99: quantile(0.99, d) };
}

function hitRate(now, old) {
  const q = now.queries - (old ? old.queries : 0), h = now.hits - (old ? old.hits : 0);
  return q > 0 ? h / q : null;
}

function tile(id, label, value, unit = "", sub = "") {
  let t = document.getElementById(id);
  if (!t) {
    t = document.createElement("div");
    t.id = id;
    t.className = "tile";
    t.innerHTML = '<div class="label"></div><div class="value"></div><div class="sub muted"></div>';
    document.getElementById("tiles").append(t);
  }
  t.querySelector(".label").textContent = label;
  t.querySelector(".value").textContent = value == null ? "–" : fmt(value) + unit;
  t.querySelector(".sub").textContent = sub;
  t.dataset.value = value == null ? "" : String(value);
}

function renderTiles(now) {
  const old = before(now, RATE_SPAN);
  const f = now.finished;
  const done = Object.values(f).reduce((a, b) => a + b, 0);
  tile("tile-running", "Running", now.running);
  tile("tile-waiting", "Waiting", now.waiting);
  tile("tile-kv", "KV cache used", now.kv == null ? null : 100 * now.kv, "%");
  const hr = hitRate(now, null);
  tile("tile-prefix", "Prefix cache hit rate", hr == null ? null : 100 * hr, "%",
    `${fmt(now.hits)} of ${fmt(now.queries)} prompt tokens`);
  tile("tile-out", "Tokens/s out", rate(now, old, "gen"), "", `${fmt(now.gen)} generated`);
  tile("tile-in", "Tokens/s in", rate(now, old, "prompt"), "", `${fmt(now.prompt)} prompt tokens`);
  tile("tile-finished", "Requests finished", done,
    "", Object.entries(f).map(([k, v]) => `${k} ${fmt(v)}`).join(" · "));
  tile("tile-preempt", "Preemptions", now.preempt);
  if (now.drafts != null) {
    const acc = now.drafts > 0 ? 100 * now.accepted / now.drafts : null;
    tile("tile-spec", "Speculative acceptance", acc, "%", `${fmt(now.accepted)} of ${fmt(now.drafts)} draft tokens`);
  }
}

function renderLatency(now) {
  const rows = Object.entries(HISTOGRAMS).map(([key, [, label]]) => {
    const p = percentiles(now, key, LATENCY_SPAN);
    const ms = (v) => (v == null ? "–" : fmt(1000 * v) + " ms");
    return `<tr id="lat-${key}" data-count="${p.count}"><th>${label}</th><td>${ms(p.p50)}</td>` +
      `<td>${ms(p.p90)}</td><td>${ms(p.p99)}</td><td>${fmt(p.count)}</td></tr>`;
  });
  document.querySelector("#latency-table tbody").innerHTML = rows.join("");
  document.getElementById("dash-note").textContent =
    `Percentiles over the last ${LATENCY_SPAN} s, interpolated inside the histograms' buckets as Prometheus' ` +
    `histogram_quantile does; rates over ${RATE_SPAN} s; /metrics read every ${INTERVAL_MS / 1000} s.`;
}

function renderCharts(now) {
  const smooth = (key) => samples.map((s) => [s.t, rate(s, before(s, RATE_SPAN), key)]);
  const age = Math.ceil((now.t - samples[0].t) / 60) * 60;
  const opts = { now: now.t, span: Math.min(WINDOW, Math.max(60, age)) };
  drawChart(document.getElementById("chart-tokens"), [
    { label: "out", color: COLORS.a, points: smooth("gen") },
    { label: "in", color: COLORS.b, points: smooth("prompt") },
  ], opts);
  drawChart(document.getElementById("chart-requests"), [
    { label: "running", color: COLORS.a, points: samples.map((s) => [s.t, s.running]) },
    { label: "waiting", color: COLORS.b, points: samples.map((s) => [s.t, s.waiting]) },
  ], opts);
  drawChart(document.getElementById("chart-cache"), [
    { label: "KV used", color: COLORS.a, points: samples.map((s) => [s.t, s.kv == null ? null : 100 * s.kv]) },
    { label: "prefix hits (10 s)", color: COLORS.c, points: samples.map((s) => {
      const r = hitRate(s, before(s, 10));
      return [s.t, r == null ? null : 100 * r];
    }) },
  ], { ...opts, max: 100 });
  const lat = (key, q) => samples.map((s) => {
    const p = percentiles(s, key, LATENCY_SPAN);
    return [s.t, p[q] == null ? null : 1000 * p[q]];
  });
  drawChart(document.getElementById("chart-latency"), [
    { label: "TTFT p50", color: COLORS.b, points: lat("ttft", "p50") },
    { label: "ITL p50", color: COLORS.a, points: lat("itl", "p50") },
    { label: "ITL p99", color: COLORS.d, points: lat("itl", "p99") },
  ], opts);
}

function render() {
  const now = samples[samples.length - 1];
  if (!now) return;
  renderTiles(now);
  if (!visible) return; // hidden charts have no size; drawn when shown
  renderLatency(now);
  renderCharts(now);
}

export function show(on) {
  visible = on;
  render();
}

export function start(onError) {
  const tick = async () => {
    try {
      const text = await (await call("metrics")).text();
      samples.push(snapshot(text));
      while (samples.length > 2 && samples[samples.length - 1].t - samples[1].t > WINDOW) samples.shift();
      onError(null);
      render();
    } catch (e) {
      onError(e);
    }
    setTimeout(tick, INTERVAL_MS);
  };
  tick();
}
