"""Warm start of `tokenmill serve`: seconds from the process's start to its first HTTP answer and
to GET /health 200, with the GGUF cache and the kernels already built (run the server once
before). Repeats and reports medians.

    python benchmarks/warm_start.py --repeats 3                  # this checkout, the default model
    python benchmarks/warm_start.py --src /other/checkout/src    # another tree, same machine
    python benchmarks/warm_start.py --breakdown                  # where the time goes, step by step

--breakdown builds the engine in this process with a timer around each step of a start (imports,
GGUF cache, config, tokenizer, model, weights, packing, KV cache, the app) and prints them."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def one_start(src: str | None, serve_args: list[str], timeout_s: float = 300.0) -> dict:
    port = _free_port()
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *serve_args]
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        first = ready = None
        try:
            while ready is None:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
                status = _status(f"http://127.0.0.1:{port}/health")
                now = time.perf_counter() - t0
                if status is not None and first is None:
                    first = now
                if status == 200:
                    ready = now
                elif now > timeout_s:
                    raise RuntimeError("no /health 200")
                else:
                    time.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.seek(0)
        engine = [ln for ln in log if "engine ready in" in ln]
    return {
        "first_answer_s": round(first, 3),
        "health_200_s": round(ready, 3),
        "engine_log": engine[0].split("engine ready in ")[1].split(":")[0] if engine else None,
    }


def breakdown() -> list[tuple[str, float]]:
    """Each step of a warm start, timed in this process (a step missing in this tree is skipped)."""
    times: list[tuple[str, float]] = []

    def timed(name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append((name, time.perf_counter() - t))

        return wrapper

    def wrap(module: str, attr: str) -> None:
        try:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, timed(f"{module.rsplit('.', 1)[-1]}.{attr}", getattr(owner, name)))
        except (ImportError, AttributeError):
            pass

    t = time.perf_counter()
    import torch  # noqa: F401

    times.append(("import torch", time.perf_counter() - t))
    t = time.perf_counter()
    import tokenmill  # noqa: F401

    times.append(("import tokenmill (after torch)", time.perf_counter() - t))
    t = time.perf_counter()
    importlib.import_module("tokenmill.engine.llm_engine")
    times.append(("import tokenmill.engine.llm_engine", time.perf_counter() - t))
    t = time.perf_counter()
    from tokenmill.server.app import build_app

    times.append(("import tokenmill.server.app", time.perf_counter() - t))
    for module, attr in [
        ("tokenmill.model.gguf_loader", "_file_key"),
        ("tokenmill.model.loader", "resolve_model_path"),
        ("tokenmill.model.loader", "load_hf_config"),
        ("tokenmill.tokenizer", "load_tokenizer"),
        ("tokenmill.kernels.cpu_kernels", "load"),
        ("tokenmill.model.loader", "model_class"),
        ("tokenmill.model.loader", "_iter_safetensors"),
        ("tokenmill.model.layers.linear", "pack_linears"),
        ("tokenmill.model.layers.quantization", "pack_quantized"),
        ("tokenmill.model.layers.weight_arena", "place_decode_weights"),
        ("tokenmill.model.loader", "load_model"),
        ("tokenmill.worker.runner", "ModelRunner.allocate_kv_cache"),
        ("tokenmill.worker.fused_decode", "FusedDecode.build"),
        ("tokenmill.engine.engine_core", "KVCacheManager"),
        ("tokenmill.engine.llm_engine", "StructuredOutputManager"),
    ]:
        wrap(module, attr)
    from tokenmill.model import loader
    from tokenmill.worker import runner

    runner.load_model = loader.load_model  # the runner's own reference, to the timed one
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.llm_engine import LLMEngine

    t = time.perf_counter()
    aengine = AsyncLLMEngine(lambda: LLMEngine.from_args(None))
    times.append(("LLMEngine (all its steps)", time.perf_counter() - t))
    t = time.perf_counter()
    build_app(aengine)
    times.append(("build_app", time.perf_counter() - t))
    aengine.shutdown()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--src", default=None, help="PYTHONPATH of the tree to measure (default: as installed)")
    p.add_argument("--breakdown", action="store_true", help="time each step of a start in this process")
    p.add_argument("serve_args", nargs="*", help="more `tokenmill serve` flags (after --)")
    ns = p.parse_args()
    if ns.breakdown:
        for name, s in breakdown():
            print(f"{s:7.3f} s  {name}")
        return
    runs = [one_start(ns.src, ns.serve_args) for _ in range(ns.repeats)]
    for r in runs:
        print(json.dumps(r))
    print(
        json.dumps(
            {
                "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs),
                "median_health_200_s": statistics.median(r["health_200_s"] for r in runs),
            }
        )
    )


if __name__ == "__main__":
    main()
