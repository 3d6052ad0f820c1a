"""The fused decode step (csrc/decode_step.cpp): a whole decode forward pass in one C++ call.

Its logits must equal the op-by-op model's bit for bit (the same kernels, the same splits), for
every weight form it takes (plain bf16, int4, int8, GGUF-style blocks), GQA, q/k/v biases, tied
embeddings and batches of several rows; the runner must use it only for small steps (all decode
rows, or, batch-invariant, requests of at most MAX_Q rows each). Multi-row steps: see
test_batch_invariance.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import cpu_kernels
from tokenmill.model.layers.linear import SMALL_BATCH
from tokenmill.model.layers.quantization import LARGE_BATCH
from tokenmill.worker.fused_decode import MAX_Q, FusedDecode

KW = dict(dtype="bfloat16", kv_cache_memory=0.02, enable_prefix_caching=False)


def _runner(llm):
    return llm.engine.core.runner


def _fused_or_skip(llm):
    fd = _runner(llm).fast_decode
    if fd is None:
        pytest.skip("no fused decode step here (needs the C++ kernels with AVX512-BF16 or AVX2 + FMA)")
    return fd


def _decode_steps(llm, prompts: list[list[int]], max_tokens: int = 3, scales: bool = False):
    """(input_ids, positions, meta, logits_rows, kv cache copy[, kv scales copy]) of each all-decode
    step of a run."""
    runner = _runner(llm)
    steps, inner = [], runner.execute

    def spy(sched):
        if all(s.num_new_tokens == 1 for s in sched.scheduled):
            step = runner.prepare(sched)
            steps.append(
                (step.input_ids, step.positions, step.meta, step.logits_rows, runner.kv_cache.clone())
                + ((runner.kv_scales.clone(),) if scales else ())
            )
        return inner(sched)

    runner.execute = spy
    try:
        llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
    finally:
        runner.execute = inner
    return steps


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("invariant", [True, False])
def test_fused_logits_equal_the_model_run_op_by_op(arch, quantization, rows, invariant, request, monkeypatch):
    """llama: GQA, untied lm_head; qwen2: q/k/v biases, tied embeddings (with int4 / int8 the
    tied table is a quantized embedding shared with the lm_head). Batch-invariant (attention by
    the rows kernel) or not (the decode kernel)."""
    monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", "1" if invariant else "0")
    _check_fused_equals_op_by_op(
        LLM(request.getfixturevalue(f"tiny_{arch}_dir"), quantization=quantization, **KW), rows
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 5])
def test_w8a8_fused_logits_equal_the_model_run_op_by_op(arch, rows, request, monkeypatch, tmp_path):
    """W8A8 linears in the step: each thread quantizes a linear's input rows per token as
    w8a8_linear does, then runs its panels (qwen2: float32 q/k/v biases)."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))  # the calibration statistics
    llm = LLM(request.getfixturevalue(f"tiny_{arch}_dir"), quantization="w8a8", **KW)
    assert type(_runner(llm).model.layers[0].mlp.down_proj).__name__ == "W8A8Linear"
    _check_fused_equals_op_by_op(llm, rows)


def _check_fused_equals_op_by_op(llm, rows: int) -> None:
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    ids, pos, meta, rows_, kv = _decode_steps(llm, _prompts(rows, llm.engine.config.model.vocab_size))[0]
    assert len(ids) == rows and meta.all_decode
    with torch.inference_mode():
        runner.kv_cache.copy_(kv)
        fused = fd(ids, pos, meta, rows_)
        fused_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(kv)
        hidden = runner.model(ids, pos, runner.attn, meta)
        want = runner.model.compute_logits(hidden[rows_])
    assert fused.dtype == torch.float32 and fused.shape == want.shape
    assert torch.equal(fused, want)
    # The same K/V written to the same slots (slots never written hold whatever memory held: NaN too).
    torch.testing.assert_close(fused_cache, runner.kv_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("invariant", [False, True])
def test_long_sequences_split_attention_across_threads(tiny_llama_dir, monkeypatch, invariant):
    """One sequence of ~300 tokens: attention splits its keys over the threads and merges (not
    batch-invariant), or its kv heads (batch-invariant: the rows kernel never splits keys)."""
    monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", "1" if invariant else "0")
    llm = LLM(tiny_llama_dir, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    ids, pos, meta, rows, kv = _decode_steps(llm, [[5 + i % 200 for i in range(300)]])[0]
    assert int(meta.decode_seq_lens[0]) > 256
    with torch.inference_mode():
        runner.kv_cache.copy_(kv)
        fused = fd(ids, pos, meta, rows)
        runner.kv_cache.copy_(kv)
        want = runner.model.compute_logits(runner.model(ids, pos, runner.attn, meta)[rows])
    assert torch.equal(fused, want)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("long", [False, True])
def test_quantized_kv_cache_equals_the_model_run_op_by_op(tiny_llama_dir, kv_cache_dtype, long):
    """An int8 / fp8 cache: the step quantizes each new K/V row as write_scaled_cache does and
    attends through the same kernel as the op-by-op model (the rows kernel on CPUs without AVX-512,
    else the decode kernel, its keys split over the threads for a ~300-token sequence), so logits,
    cache bytes and scales equal the op-by-op model's."""
    llm = LLM(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    prompts = [[5 + i % 200 for i in range(300)]] if long else _prompts(3, llm.engine.config.model.vocab_size)
    ids, pos, meta, rows, kv, sc = _decode_steps(llm, prompts, scales=True)[0]
    outs = []
    with torch.inference_mode():
        for run in (
            lambda: fd(ids, pos, meta, rows),
            lambda: runner.model.compute_logits(runner.model(ids, pos, runner.attn, meta)[rows]),
        ):
            runner.kv_cache.copy_(kv)
            runner.kv_scales.copy_(sc)
            outs.append((run(), runner.kv_cache.view(torch.uint8).clone(), runner.kv_scales.clone()))
    (fused, fused_kv, fused_sc), (want, want_kv, want_sc) = outs
    assert runner.kv_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert not torch.equal(fused_kv, kv.view(torch.uint8))  # the step wrote its K/V
    assert torch.equal(fused, want)
    assert torch.equal(fused_kv, want_kv)
    torch.testing.assert_close(fused_sc, want_sc, atol=0, rtol=0, equal_nan=True)


def test_generation_is_the_same_with_and_without_it(tiny_qwen2_dir, monkeypatch):
    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8", "Hello", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    on = LLM(tiny_qwen2_dir, **KW)
    _fused_or_skip(on)
    monkeypatch.setenv("TOKENMILL_FUSED_DECODE", "0")
    off = LLM(tiny_qwen2_dir, **KW)
    assert _runner(off).fast_decode is None
    for a, b in zip(on.generate(prompts, params), off.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_runner_uses_it_only_for_small_steps_of_few_rows_per_request(tiny_llama_dir):
    """Steps of <= SMALL_BATCH rows whose requests have <= MAX_Q rows each (batch-invariant, the
    default: decode rows, verification chunks, short prompt chunks); others op by op."""
    llm = LLM(tiny_llama_dir, max_num_seqs=SMALL_BATCH + 8, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    calls, inner = [], fd.__call__

    class Spy:
        decoder = fd.decoder
        accepts = staticmethod(fd.accepts)

        def __call__(self, input_ids, *args):
            calls.append(len(input_ids))
            return inner(input_ids, *args)

    runner.fast_decode = Spy()
    vocab = llm.engine.config.model.vocab_size
    same_length = [[5 + (i + j) % 200 for j in range(8)] for i in range(SMALL_BATCH + 4)]  # decode in step
    llm.generate(
        prompt_token_ids=same_length, sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert calls == []  # SMALL_BATCH + 4 decode rows: more than it takes, op by op
    llm.generate(
        prompt_token_ids=_prompts(3, vocab),
        sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert calls == [3, 3, 3]  # the prompt step (a 19-token prompt: > MAX_Q) ran op by op, the 3 decode steps fused
    calls.clear()
    assert MAX_Q < 19
    llm.generate(
        prompt_token_ids=_prompts(2, vocab),
        sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    assert calls == [5 + 12, 2, 2, 2]  # prompts of 5 and 12 tokens: the prompt step fused too
    calls.clear()
    llm.generate(
        prompt_token_ids=_prompts(2, vocab),
        sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1),
    )
    assert calls == [2, 2]  # prompt logprobs need hidden states: only their prompt step is op by op


def test_off_where_it_cannot_run(tiny_llama_dir):
    assert _runner(LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=0.02)).fast_decode is None


def test_bad_inputs_raise_instead_of_crashing(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **KW)
    fd = _fused_or_skip(llm)
    ids, pos, meta, rows, _ = _decode_steps(llm, [[5, 6, 7]])[0]
    with pytest.raises(RuntimeError, match="token id out of range"):
        fd(torch.tensor([10**6]), pos, meta, rows)
    with pytest.raises(RuntimeError, match="logits row"):
        fd(ids, pos, meta, [3])
    with pytest.raises(RuntimeError, match="2 norms and 4 linears per layer"):
        type(fd.decoder)(
            torch.zeros(4, 64, dtype=torch.bfloat16),
            None,
            16,
            [],
            [],
            [],
            torch.zeros(1),
            torch.zeros(1),
            1,
            1,
            64,
            64,
            4,
            1e-6,
            16,
            0.125,
        )
    assert isinstance(FusedDecode.build(_runner(llm).model, _runner(llm).attn, torch.bfloat16, 16), FusedDecode)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_decode_weights_sit_in_one_arena_in_execution_order(tiny_qwen2_dir, quantization):
    """What a small-batch step streams is one 2 MiB-aligned buffer, read front to back: each
    layer's qkv, o, gate_up and down, then the LM head; a tied quantized table stays one copy."""
    from tokenmill.kernels.memory import HUGE_PAGE
    from tokenmill.model.layers.weight_arena import _decode_tensors

    llm = LLM(tiny_qwen2_dir, quantization=quantization, **KW)
    model = _runner(llm).model
    tensors = [getattr(m, name) for m, name in _decode_tensors(model)]
    if not tensors:
        pytest.skip("no bf16 panels here (needs the C++ kernels' panel kernel)")
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1
    starts = [t.data_ptr() for t in tensors]
    layer_part = starts[: 4 * len(model.layers) * (1 if quantization is None else 2)]
    assert layer_part == sorted(layer_part) and min(starts) % HUGE_PAGE == 0
    if quantization is not None:
        assert model.embed_tokens.qweight.data_ptr() == model.lm_head.qweight.data_ptr()  # tied: one copy


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cpu_kv_cache_sits_on_huge_pages(tiny_qwen2_dir, kv_cache_dtype):
    """The CPU KV cache (and an int8 cache's scales) is one 2 MiB-aligned buffer advised for
    transparent huge pages (kernels.memory.huge_page_empty), not torch's allocation: a step reads
    blocks scattered over all of it, and on 4 KiB pages each block's read missed the TLB."""
    from tokenmill.kernels.memory import HUGE_PAGE

    llm = LLM(tiny_qwen2_dir, kv_cache_dtype=kv_cache_dtype, **KW)
    runner = _runner(llm)
    caches = [runner.kv_cache] + ([runner.kv_scales] if kv_cache_dtype == "int8" else [])
    for t in caches:
        assert t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(runner.kv_cache[:, :, : runner.block_size]) == 0  # the null block is zeroed


def _resident(t: torch.Tensor) -> torch.Tensor:
    """Which 4 KiB pages of t are in memory (mincore(2)), as a bool tensor."""
    import ctypes
    import mmap

    nbytes = t.numel() * t.element_size()
    vec = (ctypes.c_ubyte * (-(-nbytes // mmap.PAGESIZE)))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(t.data_ptr(), nbytes, vec) == 0, ctypes.get_errno()
    return torch.tensor(list(vec), dtype=torch.uint8) & 1 == 1


def test_populate_in_background_faults_pages_in_and_keeps_their_contents():
    """kernels.memory.populate_in_background: a fresh huge_page_empty buffer has no pages in memory
    until written; after the thread every page is, and what was written before is unchanged."""
    import sys

    from tokenmill.kernels.memory import huge_page_empty, populate_in_background

    if sys.platform != "linux":
        pytest.skip("mincore / MADV_POPULATE_WRITE: Linux")
    t = huge_page_empty((8 << 20,), torch.uint8)
    t[: 1 << 20] = 7  # the first MiB written; the rest never touched
    before = _resident(t)
    assert before[:256].all() and not before[-256:].any()
    populate_in_background(t).join(timeout=120)
    assert _resident(t).all()
    assert bool((t[: 1 << 20] == 7).all())


def test_runner_populates_the_cpu_kv_cache(tiny_qwen2_dir, caplog):
    """The runner starts the populating thread on its KV cache (no memset at start-up: the first
    pass through the pool would otherwise fault in the steps' threads) and keeps it, so that the
    offline benchmarks can wait for it (bench.offline.wait_for_kv_cache)."""
    from tokenmill.bench.offline import wait_for_kv_cache

    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(tiny_qwen2_dir, kv_cache_memory=0.05, dtype="bfloat16", enable_prefix_caching=False)
        assert _runner(llm).kv_populate is not None and _runner(llm).kv_populate.name == "tokenmill-populate"
        wait_for_kv_cache(llm)
    assert not _runner(llm).kv_populate.is_alive()
    # the lines benchmarks/compare/run.py waits on before it measures a tokenmill server
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "compare_run", Path(__file__).resolve().parents[2] / "benchmarks" / "compare" / "run.py"
    )
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    assert harness.POPULATE_START in caplog.text and harness.POPULATE_END[0] in caplog.text
    assert _resident(_runner(llm).kv_cache).all()
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_amx_dequantized_panels_in_the_step_equal_op_by_op(tiny_qwen2_dir, quantization):
    """Where the int4 / int8 panels run on AMX tiles over bf16-dequantized panels (from
    set_quant_amx_rows' rows: here every step), the fused step's linears take that path as the ops
    do: 6 decode rows, logits and K/V equal to the op-by-op model's."""
    kernels = cpu_kernels.load()
    if kernels is None or not hasattr(kernels, "quant_panels_amx") or not kernels.quant_panels_amx(1 << 40):
        pytest.skip("the int4 / int8 panels run on AMX tiles only where the CPU has AMX-BF16")
    llm = LLM(tiny_qwen2_dir, quantization=quantization, **KW)
    kernels.set_quant_amx_rows(1)
    try:
        _check_fused_equals_op_by_op(llm, 6)
    finally:
        kernels.set_quant_amx_rows(LARGE_BATCH)


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
def test_multi_row_steps_equal_the_model_run_op_by_op(tiny_qwen2_dir, quantization):
    """Batch-invariant: a step of requests with several query rows each (a verification chunk of 5
    after a cached prefix, a decode row, a fresh 7-token prompt) runs fused, every row's logits and
    the K/V written equal to the op-by-op model's."""
    from tokenmill.model.layers.attention import SeqChunk

    llm = LLM(tiny_qwen2_dir, quantization=quantization, **KW)
    fd = _fused_or_skip(llm)
    runner = _runner(llm)
    bs, vocab = runner.block_size, llm.engine.config.model.vocab_size
    g = torch.Generator().manual_seed(5)
    reqs = [
        (torch.randint(3, vocab, (45,), generator=g).tolist(), 40, 5, [1, 2, 3]),
        (torch.randint(3, vocab, (21,), generator=g).tolist(), 20, 1, [4, 5]),
        (torch.randint(3, vocab, (7,), generator=g).tolist(), 0, 7, [6]),
    ]
    with torch.inference_mode():
        for tokens, start, _, table in reqs[:2]:  # their cached prefixes
            slots = [table[p // bs] * bs + p % bs for p in range(start)]
            meta = runner.attn.build_metadata([SeqChunk(0, start, 0, table)], slots, bs)
            runner.model(torch.tensor(tokens[:start]), torch.arange(start), runner.attn, meta)
        ids, pos, slots, seqs = [], [], [], []
        for tokens, start, n, table in reqs:
            seqs.append(SeqChunk(len(ids), n, start, table))
            ids += tokens[start : start + n]
            pos += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        meta = runner.attn.build_metadata(seqs, slots, bs)
        ids, pos = torch.tensor(ids), torch.tensor(pos)
        assert not meta.all_decode and fd.accepts(meta, len(ids))
        kv = runner.kv_cache.clone()
        rows = torch.arange(len(ids))
        fused = fd(ids, pos, meta, rows)
        fused_cache = runner.kv_cache.clone()
        runner.kv_cache.copy_(kv)
        want = runner.model.compute_logits(runner.model(ids, pos, runner.attn, meta))
    assert torch.equal(fused, want)
    torch.testing.assert_close(fused_cache, runner.kv_cache, atol=0, rtol=0, equal_nan=True)
