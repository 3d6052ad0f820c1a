"""A script that ends with engines still alive exits 0.

Such a script printed correct results, then aborted with "terminate called without an active
exception" (exit status 134). Each CPU engine's KV cache is faulted in by a daemon thread
(kernels.memory.populate_in_background), which held the cache during each madvise call: an engine
let go meanwhile (a script's `main()` returning) lost its cache's last reference on that thread.
The cache's storage (torch.frombuffer over an mmap) is unmapped in a C++ deleter that releases the
GIL, and an interpreter exit meanwhile ended the thread with pthread_exit inside that noexcept
deleter. Several engines made it likely: their caches (GiBs, at nice 19) were still being faulted
in at the end. The script below catches that race only sometimes (it hit 1 run in 5 before the
fix); the unit test after it pins the cause: the thread never holds the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import weakref

import pytest
import torch

# The child's engines, in order: (family, dtype, GiB of KV cache). The first N_KEPT live until the
# interpreter's teardown (bf16 Llama runs the fused decode step, a C++ object holding views of its
# cache); the last are let go just before the exit with their caches still being faulted in (at
# nice 19: about a second a GiB), as in the report.
RUNS = [
    ("gemma2", "float32", 0.25),
    ("phi3", "float32", 0.25),
    ("llama", "bfloat16", 0.25),
    ("qwen3", "float32", 1.0),
    ("mixtral", "float32", 1.0),
]
N_KEPT = 3

_kept: list = []  # the child's engines that live until the interpreter's teardown


def _child(runs: list[str]) -> dict:
    """Engines ("dtype:GiB:path" each) generating a few tokens each; the first N_KEPT kept until the
    interpreter's teardown, the others let go as this returns, just before the exit (a script's
    `main()` returning). Returns {run: tokens}."""
    from tokenmill import LLM, SamplingParams

    engines, out = [], {}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, run in enumerate(runs):
        dtype, gib, path = run.split(":", 2)
        llm = LLM(path, dtype=dtype, kv_cache_memory=float(gib))
        res = llm.generate(prompt_token_ids=[[3, 4, 5, 6, 7]], sampling_params=params, use_tqdm=False)
        out[run] = list(res[0].outputs[0].token_ids)
        (_kept if i < N_KEPT else engines).append(llm)
    return out


if __name__ == "__main__":  # the child of test_a_script_with_live_engines_exits_0
    print("RESULT " + json.dumps(_child(sys.argv[1:])), flush=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[str]:
    from tiny_models import build_tiny_gemma, build_tiny_model

    out = []
    for arch, dtype, gib in RUNS:
        d = tmp_path_factory.mktemp(arch)
        out.append(f"{dtype}:{gib}:{build_tiny_gemma(d, 2) if arch == 'gemma2' else build_tiny_model(d, arch)}")
    return out


@pytest.mark.timeout(600)
def test_a_script_with_live_engines_exits_0(runs, kernels):
    """Engines of five families kept to the end or let go at it: exit status 0, no abort."""
    r = subprocess.run([sys.executable, __file__, *runs], capture_output=True, text=True, timeout=580)
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert [len(tokens) for tokens in got.values()] == [4] * len(RUNS)


def test_the_populating_thread_holds_the_address_not_the_tensor(monkeypatch):
    """Inside a madvise call the thread holds no reference to the tensor, so the tensor is freed
    where it is let go (here, once the chunk in flight is done), never on the thread."""
    from tokenmill.kernels import memory

    if sys.platform != "linux":
        pytest.skip("MADV_POPULATE_WRITE: Linux")
    in_call, go_on, freed_on = threading.Event(), threading.Event(), []

    def madvise(addr, length, advice):  # stands in for libc's; the first call waits for the test
        in_call.set()
        go_on.wait()
        return 0

    monkeypatch.setattr(memory, "_libc_madvise", lambda: madvise)
    t = memory.huge_page_empty((8 << 20,), torch.uint8)
    weakref.finalize(t, lambda: freed_on.append(threading.current_thread()))
    refs = sys.getrefcount(t)
    thread = memory.populate_in_background(t, chunk=1 << 20)
    in_call.wait()
    assert sys.getrefcount(t) == refs  # held by the thread during the call, t could be freed there
    go_on.set()
    del t  # the last reference
    thread.join()
    assert freed_on == [threading.main_thread()]
