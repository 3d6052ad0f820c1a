"""MkDocs hook: the benchmarks page (benchmarks.md), generated at build time from benchmarks/results/*.yaml.

One file per benchmark holds its current figures with the command and the machine that produced them; a new
file shows up on the page without editing it. A file's fields:

    benchmark: the title                          order: its place on the page (lower first; default 100)
    summary: what it measures, one paragraph      command: the command that produced it (a string or a list)
    machine: the machine                          date: when (YYYY-MM-DD)
    model / workload / peers: optional
    tables: [{title, columns: [first column, value columns...], rows: [{name, values, speedup_over | speedup_of}],
              note}]
    notes: [lines shown under the tables]

A row with `speedup_of: <row name>` shows, beside each value, that row's value over this one (how many times
faster the named row is); `speedup_over: <row name>` shows this value over that row's. Values that are not
numbers (text, null) are shown as they are, and get no ratio.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

PAGE = "benchmarks.md"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
REQUIRED = ("benchmark", "summary", "command", "machine", "date", "tables")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v).replace("|", "\\|")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _table(t: dict, where: str) -> list[str]:
    cols, rows = t["columns"], t["rows"]
    by_name = {r["name"]: r for r in rows}
    out = [f"**{t['title']}**", "", "| " + " | ".join(map(str, cols)) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        values = r.get("values", [])
        if len(values) != len(cols) - 1:
            raise PluginError(f"{where}: row {r['name']!r} has {len(values)} values for {len(cols) - 1} columns")
        other, over = (r.get("speedup_of"), False) if "speedup_of" in r else (r.get("speedup_over"), True)
        if other is not None and other not in by_name:
            raise PluginError(f"{where}: row {r['name']!r} compares with {other!r}, which is not a row of its table")
        cells = []
        for i, v in enumerate(values):
            cell = _fmt(v)
            if other is not None:
                w = by_name[other]["values"][i]
                if _num(v) and _num(w) and v and w:
                    cell += f" ({(v / w if over else w / v):.2f}x)"
            cells.append(cell)
        out.append(f"| {_fmt(r['name'])} | " + " | ".join(cells) + " |")
    if t.get("note"):
        out += ["", " ".join(str(t["note"]).split())]
    return out + [""]


def _load() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(RESULTS.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        missing = [k for k in REQUIRED if k not in (doc or {})]
        if missing:
            raise PluginError(f"{path}: missing {', '.join(missing)}")
        docs.append((path, doc))
    return sorted(docs, key=lambda pd: (pd[1].get("order", 100), pd[0].name))


def render() -> str:
    docs = _load()
    lines = [
        "# Benchmark results",
        "",
        "The current figures of each benchmark, with the command and the machine that produced them. Each "
        "section is one file under `benchmarks/results/` in the repository; ratios are only ever taken "
        "between figures of one run on one machine. How to run each benchmark: "
        "[Running the benchmarks](running-benchmarks.md).",
        "",
    ]
    lines += ["| benchmark | machine | date |", "|---|---|---|"]
    lines += [f"| [{d['benchmark']}](#{p.stem}) | {_fmt(d['machine'])} | {d['date']} |" for p, d in docs]
    lines.append("")
    for path, d in docs:
        lines += [f"## {d['benchmark']} {{#{path.stem}}}", "", " ".join(str(d["summary"]).split()), ""]
        commands = d["command"] if isinstance(d["command"], list) else [d["command"]]
        facts = [
            ("Machine", d["machine"]),
            ("Date", d["date"]),
            ("Model", d.get("model")),
            ("Workload", d.get("workload")),
            ("Peers", ", ".join(d["peers"]) if isinstance(d.get("peers"), list) else d.get("peers")),
        ]
        lines += [f"- {k}: {' '.join(str(v).split())}" for k, v in facts if v]
        lines += [f"- Data: `benchmarks/results/{path.name}`", "", "```bash", *commands, "```", ""]
        for t in d["tables"]:
            lines += _table(t, str(path))
        for n in d.get("notes", []):
            lines += ["- " + " ".join(str(n).split())]
        lines.append("")
    return "\n".join(lines)


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=render()))
    return files


def on_serve(server, config, builder):
    server.watch(str(RESULTS))
    return server
