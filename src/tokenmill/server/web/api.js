// Calls to the server: every one carries the API key from the page's key field (kept in
// localStorage). URLs are relative to the page, so the UI works under --root-path too.

const KEY = "tokenmill.apiKey";

export function getKey() {
  return localStorage.getItem(KEY) || "";
}

export function setKey(key) {
  if (key) localStorage.setItem(KEY, key);
  else localStorage.removeItem(KEY);
}

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function call(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  const key = getKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  const resp = await fetch(path, { ...options, headers });
  if (!resp.ok) throw new APIError(resp.status, await errorMessage(resp));
  return resp;
}

async function errorMessage(resp) {
  const text = await resp.text();
  try {
    const body = JSON.parse(text);
    const msg = body.error?.message ?? body.error ?? body.detail;
    if (msg) return `${resp.status}: ${typeof msg === "string" ? msg : JSON.stringify(msg)}`;
  } catch (e) { /* not JSON */ }
  return `${resp.status}: ${text.slice(0, 300) || resp.statusText}`;
}

// The `data:` payloads of a Server-Sent Events body, parsed as JSON, as they arrive.
export async function* sseEvents(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
