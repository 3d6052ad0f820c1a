// The chat playground: a conversation streamed from /v1/chat/completions, with the sampling
// settings, a JSON-schema mode (response_format) and a stop button that aborts the request
// (the browser closes the stream; the server aborts the request on the disconnect).

import { call, sseEvents } from "./api.js";
import { fmt } from "./chart.js";

const $ = (id) => document.getElementById(id);
let history = [];
let controller = null;
let cards = [];

export async function loadModels() {
  const body = await (await call("v1/models")).json();
  cards = body.data;
  const bases = cards.filter((c) => !c.parent);
  const model = $("model");
  const chosen = model.value;
  model.replaceChildren(...bases.map((c) => new Option(c.id, c.id)));
  if (bases.some((c) => c.id === chosen)) model.value = chosen;
  fillAdapters();
  return bases.map((c) => c.id);
}

function fillAdapters() {
  const adapter = $("adapter");
  const chosen = adapter.value;
  const own = cards.filter((c) => c.parent && c.parent === $("model").value);
  const list = own.length ? own : cards.filter((c) => c.parent);
  adapter.replaceChildren(new Option("none", ""), ...list.map((c) => new Option(c.id, c.id)));
  if (list.some((c) => c.id === chosen)) adapter.value = chosen;
  adapter.disabled = !list.length;
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

// The request body; throws an Error with a readable message for a bad schema or extra fields.
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    model: $("adapter").value || $("model").value,
    messages: messages.concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"),
    top_p: number("top-p"),
    max_tokens: number("max-tokens"),
    seed: number("seed"),
  };
  if ($("json-mode").checked) {
    let schema;
    try {
      schema = JSON.parse($("json-schema").value);
    } catch (e) {
      throw new Error(`the JSON schema does not parse: ${e.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema } };
  }
  const extra = $("extra").value.trim();
  if (extra) {
    let fields;
    try {
      fields = JSON.parse(extra);
    } catch (e) {
      throw new Error(`the extra request fields are not a JSON object: ${e.message}`);
    }
    Object.assign(body, fields);
  }
  return body;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function status(state, text) {
  const s = $("stats");
  s.dataset.state = state;
  s.textContent = text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  history.push({ role: "user", content: text });
  let body;
  try {
    body = requestBody();
  } catch (e) {
    history.pop();
    status("error", e.message);
    return;
  }
  $("prompt").value = "";
  bubble("user", text);
  const out = bubble("assistant streaming", "");
  controller = new AbortController();
  setBusy(true);
  status("waiting", "waiting for the first token…");
  const t0 = performance.now();
  let tFirst = null, tLast = null, chunks = 0, usage = null, finish = null, answer = "";
  const speed = () => {
    const n = usage ? usage.completion_tokens : chunks;
    const parts = [`TTFT ${fmt(tFirst - t0)} ms`, `${n} tokens`];
    if (n > 1 && tLast > tFirst) parts.push(`${fmt((n - 1) / ((tLast - tFirst) / 1000))} tokens/s`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt tokens`);
    return parts.join(" · ");
  };
  try {
    const resp = await call("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    for await (const event of sseEvents(resp)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices?.[0];
      if (!choice) continue;
      if (choice.finish_reason) finish = choice.finish_reason;
      const delta = choice.delta?.content;
      if (delta) {
        tLast = performance.now();
        if (tFirst == null) tFirst = tLast;
        chunks++;
        answer += delta;
        out.textContent = answer;
        out.scrollIntoView({ block: "end" });
        status("streaming", speed());
      }
    }
    let note = `finish: ${finish}`;
    if (body.response_format) {
      try {
        JSON.parse(answer);
        note += " · valid JSON";
      } catch (e) {
        note += " · not valid JSON (cut by max tokens?)";
      }
    }
    status("done", tFirst == null ? note : `${speed()} · ${note}`);
  } catch (e) {
    if (e.name === "AbortError") {
      status("stopped", `stopped · ${tFirst == null ? "before the first token" : speed()}`);
    } else {
      out.classList.add("error");
      if (!answer) out.textContent = e.message;
      status("error", e.message);
    }
  } finally {
    out.classList.remove("streaming");
    if (answer) history.push({ role: "assistant", content: answer });
    else if (history.at(-1)?.role === "user") history.pop(); // nothing came back: let the user edit and resend
    controller = null;
    setBusy(false);
  }
}

export function stop() {
  if (controller) controller.abort();
}

export function init() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    stop();
    history = [];
    $("messages").replaceChildren();
    status("", "");
  });
  $("model").addEventListener("change", fillAdapters);
  $("json-mode").addEventListener("change", () => {
    $("json-schema").hidden = !$("json-mode").checked;
  });
}
