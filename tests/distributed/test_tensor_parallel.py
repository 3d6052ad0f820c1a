"""Tensor parallelism: N ranks (the engine's process + N-1 spawned workers) give the tokens and
logprobs of one rank and of transformers; workers are pinned, read only their slices, and never
outlive the engine or hang it when they die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hf_oracle import hf_greedy, matching_prefix
from tiny_models import build_tiny_model

from tokenmill import LLM, SamplingParams

KW = dict(dtype="float32", kv_cache_memory=0.02, device="cpu")  # gloo ranks, on a GPU machine too
PROMPTS = [[5 + (11 * i + 3 * j) % 200 for j in range(6 + 9 * i)] for i in range(5)]


def _greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _tp(model_dir: str, size: int, **kw) -> LLM:
    return LLM(model_dir, tensor_parallel_size=size, **{**KW, **kw})


@pytest.fixture(scope="module")
def tp2_llama(tiny_llama_dir):
    llm = _tp(tiny_llama_dir, 2)
    yield llm
    llm.shutdown()


def _tokens_and_logprobs(llm: LLM, prompts=PROMPTS, **kw):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(logprobs=0, **kw))
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]) for o in outs]


def _assert_match_oracle(llm: LLM, model_dir: str, prompts=PROMPTS, max_tokens: int = 16) -> None:
    for (toks, lps), p in zip(_tokens_and_logprobs(llm, prompts, max_tokens=max_tokens), prompts):
        exp = hf_greedy(model_dir, p, max_tokens)
        n = matching_prefix(toks, exp)
        assert max(abs(a - b) for a, b in zip(lps[: n + 1], exp[1])) < 1e-3


def _assert_same(a, b) -> None:
    """Two runs of the same model agree: tokens (up to a near-tie) and logprobs within 1e-3."""
    for (ta, la), (tb, lb) in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        if n < len(ta):  # a different pick is only fine where the two were within a near-tie
            assert abs(la[n] - lb[n]) < 1e-3, (ta, tb)
        assert max(abs(x - y) for x, y in zip(la[: n + 1], lb[: n + 1])) < 1e-3


def test_sizes_that_do_not_divide_are_refused(smollm2_dir, tiny_llama_dir):
    with pytest.raises(ValueError, match=r"9 attention heads, 3 kv heads .* sizes that work: 1, 3"):
        LLM(smollm2_dir, tensor_parallel_size=2, kv_cache_memory=0.1)
    with pytest.raises(ValueError, match="--quantization gguf .* cannot be split"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, quantization="gguf", **KW)


def test_each_rank_reads_its_slices(tiny_llama_dir):
    """Rank 1 of 2 (no collectives needed to load) holds the second half of every split weight."""
    from hf_oracle import load_hf

    from tokenmill.distributed.comm import TPGroup
    from tokenmill.model.loader import load_hf_config, load_model

    cfg = load_hf_config(tiny_llama_dir)
    model = load_model(tiny_llama_dir, cfg, torch.float32, 64, tp=TPGroup(rank=1, size=2))
    hf = load_hf(tiny_llama_dir).model
    a, ha = model.layers[0].self_attn, hf.layers[0].self_attn
    hd = a.head_dim
    assert (a.num_heads, a.num_kv_heads) == (2, 1)
    q, k, v = a.qkv_proj.weight.split([2 * hd, hd, hd])
    assert torch.equal(q, ha.q_proj.weight[2 * hd :]) and torch.equal(k, ha.k_proj.weight[hd:])
    assert torch.equal(v, ha.v_proj.weight[hd:])
    assert torch.equal(a.o_proj.weight, ha.o_proj.weight[:, 2 * hd :])
    m, hm = model.layers[0].mlp, hf.layers[0].mlp
    gate, up = m.gate_up_proj.weight.split(64)
    assert torch.equal(gate, hm.gate_proj.weight[64:]) and torch.equal(up, hm.up_proj.weight[64:])
    assert torch.equal(m.down_proj.weight, hm.down_proj.weight[:, 64:])
    assert torch.equal(model.embed_tokens.weight, hf.embed_tokens.weight)  # replicated
    vocab, per = cfg.vocab_size, -(-cfg.vocab_size // 2)  # an odd vocabulary: rank 1's slice is padded
    head = model.lm_head.weight
    assert vocab % 2 and head.shape[0] == per
    assert (
        torch.equal(head[: vocab - per], load_hf(tiny_llama_dir).lm_head.weight[per:]) and not head[vocab - per :].any()
    )


def test_tp2_matches_one_rank_and_transformers(tp2_llama, tiny_llama_llm, tiny_llama_dir):
    _assert_match_oracle(tp2_llama, tiny_llama_dir)
    _assert_same(_tokens_and_logprobs(tp2_llama), _tokens_and_logprobs(tiny_llama_llm))
    kv = tp2_llama.engine.core.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_tp2_workers_are_pinned_to_their_own_cores(tp2_llama):
    workers = tp2_llama.engine.core.runner.workers
    assert len(workers.procs) == 1 and workers.procs[0].is_alive()
    with open(f"/proc/{workers.procs[0].pid}/status") as f:
        allowed = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
    assert _cpu_list(allowed) == set(workers.cores[1])
    if len(os.sched_getaffinity(0) | set(workers.cores[0])) >= 2:  # enough CPUs: the ranks do not overlap
        assert not set(workers.cores[0]) & set(workers.cores[1])


def _cpu_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_tp2_chunked_prefill_preemption_prefix_caching_prompt_logprobs(tiny_llama_dir, tiny_llama_llm):
    """Prompt chunks of 8 tokens, a KV pool so small that requests are preempted, prefix hits on
    the second round, and prompt logprobs: the same tokens and logprobs as one rank unconstrained."""
    llm = _tp(tiny_llama_dir, 2, max_num_batched_tokens=8, num_gpu_blocks_override=12, block_size=4)
    try:
        prompts = [[7 + (5 * i + j) % 100 for j in range(10 + 3 * i)] for i in range(4)]
        ref = _tokens_and_logprobs(tiny_llama_llm, prompts)
        _assert_same(_tokens_and_logprobs(llm, prompts), ref)
        stats = llm.engine.core.scheduler.stats()
        assert stats["num_preemptions"] > 0
        _assert_same(_tokens_and_logprobs(llm, prompts), ref)  # again: prefix-cache hits
        assert llm.engine.core.kv.stats.hits > 0
        want = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
        got = llm.generate(prompt_token_ids=prompts[:2], sampling_params=want)
        exp = tiny_llama_llm.generate(prompt_token_ids=prompts[:2], sampling_params=want)
        for g, e in zip(got, exp):
            pairs = [
                (next(iter(a.values())).logprob, next(iter(b.values())).logprob)
                for a, b in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:])
            ]
            assert len(pairs) == len(g.prompt_token_ids) - 1 and max(abs(a - b) for a, b in pairs) < 1e-3
        kv = llm.engine.core.kv
        assert kv.num_free_blocks == kv.num_usable_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("extra", [dict(kv_cache_dtype="int8"), dict(quantization="int4")], ids=["int8-kv", "int4"])
def test_tp2_int8_kv_and_int4_weights_match_one_rank(tiny_llama_dir, extra, monkeypatch):
    """Each rank quantizes its own shard; groups of 32 columns fall on the shard boundaries, so the
    quantized weights are those of one rank, and so are the int8 K/V of each head. (int4 with float
    activations, the row kernel: AVX2's int8 activations round the all-reduce's last-bit
    differences to whole codes now and then, 1e-2 nats apart, not the weights' doing.)"""
    monkeypatch.setenv("TOKENMILL_QUANT_PANELS", "0")  # inherited by the ranks' processes
    one = LLM(tiny_llama_dir, **{**KW, **extra})
    ref = _tokens_and_logprobs(one)
    llm = _tp(tiny_llama_dir, 2, **extra)
    try:
        _assert_same(_tokens_and_logprobs(llm), ref)
    finally:
        llm.shutdown()


def test_tp2_qwen2_tied_embeddings_and_qkv_bias(tiny_qwen2_dir):
    llm = _tp(tiny_qwen2_dir, 2)
    try:
        _assert_match_oracle(llm, tiny_qwen2_dir)
    finally:
        llm.shutdown()


def test_tp3_uneven_vocab_matches_transformers(tmp_path_factory):
    """6 query / 3 kv heads split 3 ways; the vocabulary (not a multiple of 3) padded in the LM head."""
    model_dir = str(
        build_tiny_model(
            tmp_path_factory.mktemp("tiny-6h"),
            "llama",
            num_attention_heads=6,
            num_key_value_heads=3,
            hidden_size=96,
            intermediate_size=96,
        )
    )
    llm = _tp(model_dir, 3)
    try:
        assert llm.engine.config.model.vocab_size % 3
        _assert_match_oracle(llm, model_dir)
    finally:
        llm.shutdown()


def test_tp3_smollm2_matches_transformers(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", kv_cache_memory=0.1, max_model_len=512, tensor_parallel_size=3)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
        _assert_match_oracle(llm, smollm2_dir, prompts, max_tokens=8)
    finally:
        llm.shutdown()


def test_a_dead_worker_fails_the_engine_loudly(tiny_llama_dir):
    llm = _tp(tiny_llama_dir, 2)
    try:
        llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=_greedy(2))
        worker = llm.engine.core.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        from tokenmill.worker.executor import TPWorkerDied

        with pytest.raises(TPWorkerDied, match="rank 1 .* died"):
            llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=_greedy(4))
    finally:
        llm.shutdown()


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Serve:
    """`tokenmill serve --tensor-parallel-size 2` in a subprocess, its log collected by a thread."""

    def __init__(self, model_dir: str):
        import socket
        import threading

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenmill.cli",
                "serve",
                model_dir,
                "--tensor-parallel-size",
                "2",
                "--dtype",
                "float32",
                "--kv-cache-memory",
                "0.02",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> list[int]:
        """Waits until the server answers; returns the worker pids its log names."""
        _wait(lambda: self.healthy() or self.proc.poll() is not None, 240, "the server")
        assert self.proc.poll() is None, "".join(self.lines)
        line = next(ln for ln in self.lines if "worker pids" in ln)
        return [int(p) for p in line.rsplit("[", 1)[1].rstrip("]\n ").split(",")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)


def test_serve_exits_nonzero_when_a_worker_dies(tiny_llama_dir):
    srv = _Serve(tiny_llama_dir)
    try:
        workers = srv.start()
        os.kill(workers[0], signal.SIGKILL)
        assert srv.proc.wait(60) == 1
        srv.reader.join(10)
        assert any("rank 1" in ln and "died" in ln for ln in srv.lines), "".join(srv.lines[-20:])
    finally:
        srv.close()


def test_sigterm_stops_the_workers(tiny_llama_dir):
    srv = _Serve(tiny_llama_dir)
    try:
        workers = srv.start()
        assert all(_alive(w) for w in workers)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        _wait(lambda: not any(_alive(w) for w in workers), 30, "the workers to exit")
    finally:
        srv.close()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp", "torch"])
def test_shm_all_reduce_sums_in_rank_order_and_aborts(tmp_path, use_kernel):
    """Two ranks as two threads (the kernel releases the GIL): every call, bigger than a slot
    too, gives both the float32 sum; a raised abort flag ends a wait with TPAborted."""
    import threading

    from tokenmill.distributed.comm import ShmAllReduce, TPAborted

    path = str(tmp_path / "shm")
    ShmAllReduce(path, 0, 2, 1024, create=True).close()  # 256 float32 per slot
    ranks = [ShmAllReduce(path, r, 2, 1024, create=False) for r in range(2)]
    if not use_kernel:
        for r in ranks:
            r.kernel = None
    elif ranks[0].kernel is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    inputs = [
        [torch.randn(n, generator=g).to(dtype) for n, dtype in ((3, torch.float32), (700, torch.bfloat16))]
        for _ in range(2)
    ]
    outs: list = [None, None]

    def run(r):
        outs[r] = [ranks[r].all_reduce(x.clone()) for x in inputs[r]]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, (a, b) in enumerate(zip(*inputs)):
        want = (a.float() + b.float()).to(a.dtype)
        assert torch.equal(outs[0][i], want) and torch.equal(outs[1][i], want)
    ranks[1].abort()
    with pytest.raises(TPAborted):
        ranks[0].all_reduce(torch.ones(4))  # rank 1 never comes


def test_tp2_fused_decode_step_equals_op_by_op(tiny_llama_dir, monkeypatch):
    """bf16: each rank runs its shard's decode steps in the C++ fused step with the all-reduces
    inside it; the logprobs equal those of the same ranks run op by op."""
    fused = _tp(tiny_llama_dir, 2, dtype="bfloat16")
    try:
        if fused.engine.core.runner.fast_decode is None:
            pytest.skip("no fused decode step here (needs the C++ kernels with AVX512-BF16 or AVX2 + FMA)")
        got = _tokens_and_logprobs(fused)
    finally:
        fused.shutdown()
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")  # read by every rank as it builds (workers inherit it)
    plain = _tp(tiny_llama_dir, 2, dtype="bfloat16")
    try:
        assert plain.engine.core.runner.fast_decode is None
        assert got == _tokens_and_logprobs(plain)
    finally:
        plain.shutdown()


def test_shm_gather_to_first_in_pieces(tmp_path):
    """Rank 1's rows reach rank 0 beside its own, in pieces when they outgrow a slot."""
    import threading

    from tokenmill.distributed.comm import ShmAllReduce

    path = str(tmp_path / "shm")
    ShmAllReduce(path, 0, 2, 4 * 40, create=True).close()  # 40 float32 per slot: 3 rows of 12 a piece
    ranks = [ShmAllReduce(path, r, 2, 4 * 40, create=False) for r in range(2)]
    xs = [torch.arange(7 * 12, dtype=torch.float32).view(7, 12) + 1000 * r for r in range(2)]
    outs: list = [None, None]
    threads = [
        threading.Thread(target=lambda r=r: outs.__setitem__(r, ranks[r].gather_to_first(xs[r]))) for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outs[1] is None and torch.equal(outs[0], torch.cat(xs, dim=1))


def test_process_group_collectives_and_min(monkeypatch):
    """The process-group path (gloo here; NCCL on GPUs runs the same calls on cuda tensors): two
    ranks as threads sum, gather to rank 0 and agree on the smallest KV block count."""
    import socket
    import threading

    from tokenmill.distributed.comm import TPGroup

    monkeypatch.setenv("TOKENMILL_TP_ALLREDUCE", "gloo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    xs = [torch.arange(6, dtype=torch.bfloat16).view(2, 3) * (r + 1) for r in range(2)]
    outs: list = [None, None]

    def run(r):
        g = TPGroup.connect(r, 2, port, "", 0, timeout_s=60)
        try:
            outs[r] = (g.all_reduce(xs[r].clone()), g.gather_to_first(xs[r].float()), g.min(1000 - 7 * r))
        finally:
            g.close()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        total, gathered, smallest = outs[r]
        assert torch.equal(total, xs[0] + xs[1]) and smallest == 993
        assert (gathered is None) == (r == 1)
    assert torch.equal(outs[0][1], torch.cat([xs[0].float(), xs[1].float()], dim=1))
