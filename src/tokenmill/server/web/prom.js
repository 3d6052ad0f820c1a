// The Prometheus text format of /metrics, read in the browser: the dashboard shows the engine's
// own metrics, the ones a Prometheus server would scrape. Series are keyed by their name after the
// prefix ("tokenmill:num_requests_running" -> "num_requests_running"), so a renamed prefix, or
// the `replica` label of Ray Serve replicas, reads the same (series of one name are summed).

export function parse(text) {
  const series = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    let i = 0;
    while (i < line.length && line[i] !== "{" && line[i] !== " ") i++;
    const name = line.slice(0, i);
    const labels = {};
    if (line[i] === "{") {
      const start = ++i;
      let quoted = false;
      for (; i < line.length; i++) {
        const c = line[i];
        if (c === "\\") i++;
        else if (c === '"') quoted = !quoted;
        else if (c === "}" && !quoted) break;
      }
      for (const m of line.slice(start, i).matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[m[1]] = m[2];
      i++;
    }
    const value = parseFloat(line.slice(i).trim().split(" ")[0]);
    const key = name.slice(name.lastIndexOf(":") + 1);
    if (!series.has(key)) series.set(key, []);
    series.get(key).push({ labels, value });
  }
  return series;
}

// The sum of every series of a name (optionally only those whose labels match), or null if absent.
export function total(series, name, match = {}) {
  const list = series.get(name);
  if (!list) return null;
  let sum = 0;
  for (const s of list) {
    if (Object.entries(match).every(([k, v]) => s.labels[k] === v)) sum += s.value;
  }
  return sum;
}

// The mean of every series of a name (a fraction per replica, say), or null if absent.
export function mean(series, name) {
  const list = series.get(name);
  return list && list.length ? total(series, name) / list.length : null;
}

// A histogram's cumulative buckets summed over its series: [[upper bound, count], ...] by bound.
export function buckets(series, name) {
  const byLe = new Map();
  for (const s of series.get(name + "_bucket") || []) {
    const le = s.labels.le === "+Inf" ? Infinity : parseFloat(s.labels.le);
    byLe.set(le, (byLe.get(le) || 0) + s.value);
  }
  return [...byLe.entries()].sort((a, b) => a[0] - b[0]);
}

// Bucket counts observed between two scrapes (older may be null: since the start).
export function bucketDelta(now, older) {
  if (!older) return now;
  const before = new Map(older);
  return now.map(([le, n]) => [le, Math.max(0, n - (before.get(le) || 0))]);
}

// Prometheus' histogram_quantile: the q-quantile by linear interpolation inside the bucket where
// the rank falls (the lowest bucket starts at 0; a rank in the +Inf bucket gives the highest
// finite bound). null when nothing was observed.
export function quantile(q, cumulative) {
  if (!cumulative.length) return null;
  const count = cumulative[cumulative.length - 1][1];
  if (!count) return null;
  const rank = q * count;
  let prevLe = 0, prevN = 0;
  for (const [le, n] of cumulative) {
    if (n >= rank) {
      if (le === Infinity) return prevLe;
      if (n === prevN) return le;
      return prevLe + (le - prevLe) * (rank - prevN) / (n - prevN);
    }
    prevLe = le;
    prevN = n;
  }
  return prevLe;
}
