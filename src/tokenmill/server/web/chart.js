// Small SVG line charts for the dashboard: time on x (the last `span` seconds), values on y from
// 0 to a round maximum, one line per series and a legend with each series' latest value.

const NS = "http://www.w3.org/2000/svg";
const M = { left: 44, right: 10, top: 22, bottom: 18 };

export function fmt(v, digits = 3) {
  if (v == null || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toPrecision(digits) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(digits) + "k";
  if (a >= 100 || Number.isInteger(v)) return String(Math.round(v));
  return v.toPrecision(digits).replace(/\.?0+$/, "");
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function el(name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text != null) e.textContent = text;
  return e;
}

// series: [{label, color, points: [[t seconds, value or null], ...]}]; opts: {now, span, max, unit}.
export function drawChart(svg, series, { now, span, max = null, unit = "" }) {
  const w = svg.clientWidth || 480, h = svg.clientHeight || 170;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const pw = w - M.left - M.right, ph = h - M.top - M.bottom;
  let top = max;
  if (top == null) {
    let hi = 0;
    for (const s of series) for (const [, v] of s.points) if (v != null && v > hi) hi = v;
    top = niceMax(hi);
  }
  const x = (t) => M.left + pw * (1 - (now - t) / span);
  const y = (v) => M.top + ph * (1 - Math.min(v, top) / top);
  for (const f of [0, 0.5, 1]) {
    const gy = M.top + ph * (1 - f);
    svg.append(el("line", { x1: M.left, x2: w - M.right, y1: gy, y2: gy, class: "grid" }));
    svg.append(el("text", { x: M.left - 4, y: gy + 4, "text-anchor": "end", class: "axis" }, fmt(top * f) + unit));
  }
  const step = [10, 15, 30, 60, 120].find((st) => span / st <= 6) || 300;
  for (let ago = 0; ago <= span + 0.5; ago += step) {
    const label = ago === 0 ? "now" : ago < 60 ? `-${ago}s` : `-${fmt(ago / 60)}m`;
    svg.append(el("text", { x: x(now - ago), y: h - 4, "text-anchor": ago === 0 ? "end" : "middle", class: "axis" },
      label));
  }
  let lx = M.left;
  for (const s of series) {
    let d = "", pen = "M", last = null;
    for (const [t, v] of s.points) {
      if (now - t > span) continue;
      if (v == null) { // a gap: no line drawn across it
        pen = "M";
        continue;
      }
      d += `${pen}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = "L";
      last = v;
    }
    if (d.includes("L")) svg.append(el("path", { d, class: "line", stroke: s.color }));
    svg.append(el("rect", { x: lx, y: 6, width: 10, height: 10, fill: s.color, rx: 2 }));
    const label = el("text", { x: lx + 14, y: 15, class: "legend" }, `${s.label} ${fmt(last)}${unit}`);
    svg.append(label);
    lx += 24 + 7 * label.textContent.length;
  }
}
