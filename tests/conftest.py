from __future__ import annotations

import contextlib
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped where torch sees fewer CUDA GPUs than they ask for
    (gpu(count=N), 1 by default)."""
    marked = [(it, it.get_closest_marker("gpu")) for it in items if it.get_closest_marker("gpu")]
    if not marked:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for it, mark in marked:
        need = mark.kwargs.get("count", 1)
        if have < need:
            it.add_marker(pytest.mark.skip(reason="needs a CUDA GPU" if need == 1 else f"needs {need} CUDA GPUs"))


@pytest.fixture(scope="session")
def kernels():
    """The engine's C++ CPU kernels (built once; a build failure fails the tests using them)."""
    from tokenmill.kernels import cpu_kernels

    mod = cpu_kernels.load()
    if mod is None:
        pytest.fail("C++ CPU kernels failed to build")
    return mod


@pytest.fixture(scope="session")
def triton_interpreter():
    """For tests that run the Triton kernels under TRITON_INTERPRET=1 in a child process: the
    interpreter of triton < 3.7 (torch 2.11's bundled 3.6) turns a scalar load into a 1-element
    array that `range` refuses; pyproject's `gpu` extra asks for >= 3.7."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(f"triton {triton.__version__}'s interpreter cannot run the kernels (>= 3.7 can)")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_llm(tiny_llama_dir):
    from tokenmill import LLM

    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)


@pytest.fixture(scope="session")
def tiny_qwen2_llm(tiny_qwen2_dir):
    from tokenmill import LLM

    return LLM(tiny_qwen2_dir, dtype="float32", kv_cache_memory=0.02)


PROMPTS = [
    "Hello world, the quick",
    "Paged attention keeps",
    "def add(a, b):",
    "Les élèves étudient",
    "1234567890 + - * /",
    "Continuous batching admits new requests every step. The quick brown fox jumps over the lazy dog.",
    "東京 北京 😀",
    "The",
]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """The packaged SmolLM2 GGUF converted once into a session cache folder."""
    from tokenmill.model.gguf_loader import default_model_path, gguf_to_hf_folder

    return gguf_to_hf_folder(default_model_path(), cache_dir=str(tmp_path_factory.mktemp("tm-cache")))


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    from tokenmill import LLM

    return LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.5)


@contextlib.contextmanager
def running_server(model_dir: str, app_kwargs: dict | None = None, **engine_kwargs):
    """A real uvicorn server on a free loopback port over a fresh engine (app_kwargs: ServerArgs
    fields, api_key, ...); always stopped."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.server.app import BackgroundServer, build_app
    from tokenmill.server.args import ServerArgs

    aengine = AsyncLLMEngine.from_args(model_dir, **{"dtype": "float32", "kv_cache_memory": 0.05, **engine_kwargs})
    server = BackgroundServer(build_app(aengine, ServerArgs(**(app_kwargs or {}))))
    try:
        server.start()
        yield server, aengine
    finally:
        server.stop()
        aengine.shutdown()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    """SmolLM2 (bf16) behind a real server, one per test module: .url, .aengine, .model, .client (openai),
    .ctx (the app's ServerContext)."""
    import types

    import openai

    with running_server(smollm2_dir, dtype="bfloat16", kv_cache_memory=0.5) as (server, aengine):
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield types.SimpleNamespace(
                url=server.url,
                aengine=aengine,
                client=client,
                model=aengine.engine.config.model.name,
                ctx=server.server.config.app.state.ctx,
            )


@pytest.fixture(scope="module")
def smollm2_client(smollm2_server):
    return smollm2_server.client


@pytest.fixture(scope="module")
def smollm2_model(smollm2_server):
    return smollm2_server.model


def wait_engine_idle(aengine, timeout: float = 30.0) -> bool:
    """Until no request is left in the scheduler and every KV block is back in the pool (an aborted
    or finished request's blocks come back on the engine's next step); False if not by `timeout`."""
    import time

    kv, sched = aengine.engine.core.kv, aengine.engine.core.scheduler
    deadline = time.monotonic() + timeout
    while sched.requests or kv.num_free_blocks != kv.num_usable_blocks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def reference_paged_decode(
    q, k_cache, v_cache, tables, lens, bs: int, scale: float | None = None, window: int = 0, softcap: float = 0.0
):
    """Decode attention in float32 through block tables, the way SDPA computes it: [B, H, D].
    window > 0: each query reads its last `window` keys only; softcap > 0: scores soft-capped."""
    import torch
    import torch.nn.functional as F

    out = []
    for b in range(q.shape[0]):
        L = int(lens[b])
        pos = torch.arange(max(0, L - window) if window else 0, L)
        slots = tables[b, pos // bs] * bs + pos % bs
        k = k_cache[slots].float().transpose(0, 1)
        v = v_cache[slots].float().transpose(0, 1)
        qb = q[b].float().unsqueeze(1)
        if softcap:
            rep = qb.shape[0] // k.shape[0]
            s = qb @ k.repeat_interleave(rep, 0).transpose(1, 2) * (scale or qb.shape[-1] ** -0.5)
            p = (torch.tanh(s / softcap) * softcap).softmax(-1)
            out.append((p @ v.repeat_interleave(rep, 0)).squeeze(1))
        else:
            out.append(F.scaled_dot_product_attention(qb, k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)


def record_multi_row_fused_steps(llm) -> list[int]:
    """The row counts of the steps with more than decode rows (verification or prompt chunks) that
    llm's fused step takes from now on (its accepts() wrapped); stays empty without a fused step."""
    fd, multi = llm.engine.core.runner.fast_decode, []
    if fd is not None:
        inner = fd.accepts

        def accepts(meta, rows):
            ok = inner(meta, rows)
            if ok and not meta.all_decode:
                multi.append(rows)
            return ok

        fd.accepts = accepts
    return multi


def free_port() -> int:
    """A free loopback port (bound, then released for a server to take)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
