"""The GPU path: the Triton attention backend in the engine, CUDA graphs, sampling and KV sizing on cuda.

On a CPU machine (CI) the engine runs the Triton backend on CPU tensors under TRITON_INTERPRET=1
in a child process (triton reads that variable when first imported) and must give the C++
backend's tokens: chunked prefill, prefix-cache hits, preemption, int8 KV and the CUDA-graph
buckets' padded batches (run eagerly). Tests marked `gpu` need a CUDA GPU and are skipped without one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from tokenmill import LLM, SamplingParams

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)
two_gpus = pytest.mark.gpu(count=2)
PROMPTS = [[1, 5, 9, 33, 7] * 4, [3, 4, 5] * 30, [11] * 3, list(range(2, 60))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _scenarios(model_dir: str, **kw) -> dict[str, list]:
    """Greedy tokens of PROMPTS under the engine features that change attention's metadata."""
    out = {}
    base = dict(dtype="float32", block_size=16, **kw)

    def run(llm, name, params=GREEDY, prompts=PROMPTS):
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        out[name] = [o.outputs[0].token_ids for o in res]
        return res

    llm = LLM(model_dir, kv_cache_memory=0.02, max_num_batched_tokens=24, **base)  # prompts in 24-token chunks
    run(llm, "chunked")
    run(llm, "prefix_hits")  # the same prompts again: their full blocks come from the cache
    out["prefix_hits_count"] = llm.engine.core.kv.stats.hits
    res = run(
        llm, "logprobs", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    )
    out["logprob_values"] = [
        [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in res
    ]
    llm.shutdown()
    llm = LLM(model_dir, num_gpu_blocks_override=9, max_num_batched_tokens=64, **base)  # 8 blocks: preemption
    run(llm, "preempted", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), PROMPTS[:3])
    out["preemptions"] = llm.engine.core.scheduler.num_preemptions
    llm.shutdown()
    llm = LLM(model_dir, kv_cache_memory=0.02, kv_cache_dtype="int8", **base)
    res = run(llm, "int8_kv", SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=0))
    out["int8_logprobs"] = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in res]
    llm.shutdown()
    return out


def _graph_buckets(model_dir: str) -> dict[str, list]:
    """CUDA-graph decode (eager on CPU): 3 and 5 rows padded to buckets 4 and 8."""
    from tokenmill.worker.cuda_graphs import CudaGraphDecode

    llm = LLM(model_dir, dtype="float32", kv_cache_memory=0.02)
    runner = llm.engine.core.runner
    cuda = runner.device.type == "cuda"
    graphs = CudaGraphDecode.capture(runner, 8) if cuda else CudaGraphDecode(runner, 8, graphs=False)
    rows: list[int] = []

    class Counting:
        def accepts(self, meta, n):
            return graphs.accepts(meta, n)

        def __call__(self, input_ids, *rest):
            rows.append(input_ids.shape[0])
            return graphs(input_ids, *rest)

    runner.fast_decode = Counting()
    res = llm.generate(prompt_token_ids=PROMPTS[:3] + PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False)
    llm.shutdown()
    return {"graph_buckets": [o.outputs[0].token_ids for o in res], "graph_rows": sorted(set(rows))}


if __name__ == "__main__":  # the child: the Triton backend on the CPU (TRITON_INTERPRET=1 set by the parent)
    logging.disable(logging.INFO)
    result = _scenarios(sys.argv[1])
    result.update(_graph_buckets(sys.argv[1]))
    print("RESULT " + json.dumps(result))


@pytest.mark.slow
def test_triton_backend_in_the_engine_equals_cpu_backend(tiny_llama_dir, kernels, triton_interpreter):
    env = {**os.environ, "TRITON_INTERPRET": "1", "TOKENMILL_ATTENTION_BACKEND": "triton"}
    r = subprocess.run([sys.executable, __file__, tiny_llama_dir], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    triton_run = json.loads(r.stdout.split("RESULT ", 1)[1])
    cpu_run = _scenarios(tiny_llama_dir)
    for name in ("chunked", "prefix_hits", "logprobs", "preempted", "int8_kv"):
        assert triton_run[name] == cpu_run[name], name
    # int8 KV: the C++ backend attends a fresh prompt's own K/V unquantized, Triton (as vLLM's
    # backends) what it wrote to the cache: the first token's logprob differs by int8 rounding only.
    assert triton_run["int8_logprobs"] == pytest.approx(cpu_run["int8_logprobs"], abs=5e-2)
    assert triton_run["preemptions"] > 0 and triton_run["prefix_hits_count"] > 0
    for a, b in zip(triton_run["logprob_values"], cpu_run["logprob_values"]):
        assert a == pytest.approx(b, abs=1e-4)
    # Padded buckets: the five sequences decode as 5 rows (bucket 8), then fewer as they finish.
    assert triton_run["graph_buckets"] == cpu_run["chunked"][:3] + cpu_run["chunked"][:2]
    assert 5 in triton_run["graph_rows"]


def test_bucket_sizes():
    from tokenmill.worker.cuda_graphs import bucket_sizes

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(256)[-3:] == [240, 248, 256]


def test_device_flag_errors(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown device"):
        LLM(tiny_llama_dir, device="tpu")
    with pytest.raises(ValueError, match="float16 runs on GPUs only"):
        LLM(tiny_llama_dir, device="cpu", dtype="float16")
    with pytest.raises(ValueError, match="load_format"):
        LLM(tiny_llama_dir, device="cpu", load_format="pt")
    if not CUDA:
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(tiny_llama_dir, device="cuda")


def test_dummy_weights_load_without_checkpoint(tiny_llama_dir, tmp_path):
    import shutil

    for name in os.listdir(tiny_llama_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama_dir, name), tmp_path / name)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy", kv_cache_memory=0.02)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kv_cache_memory=0.02)


# ---- on a GPU --------------------------------------------------------------------------------------


def _hf_greedy_cuda(model_dir: str, prompt: list[int], n: int, dtype: torch.dtype):
    """transformers on the same GPU: greedy tokens and each step's top-1 minus top-2 logprob."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    tokens, margins = [], []
    with torch.inference_mode():
        for _ in range(n):
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
            top2 = lp.topk(2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            ids = torch.cat([ids, top2.indices[:1].view(1, 1)], dim=1)
    return tokens, margins


def _agree(got: list[int], expected: list[int], margins: list[float], near_tie: float) -> None:
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            assert margins[i] < near_tie, f"token {i}: {got} != {expected} (margin {margins[i]:.2e})"
            return


@gpu
@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_greedy_equals_transformers(arch_dir, eager, request):
    model_dir = request.getfixturevalue(arch_dir)
    for dtype, near_tie in (("float32", 1e-3), ("bfloat16", 5e-2)):
        llm = LLM(
            model_dir, device="cuda", dtype=dtype, enforce_eager=eager, gpu_memory_utilization=0.3, max_num_seqs=16
        )
        res = llm.generate(
            prompt_token_ids=PROMPTS,
            sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        for prompt, o in zip(PROMPTS, res):
            expected, margins = _hf_greedy_cuda(model_dir, prompt, 16, getattr(torch, dtype))
            _agree(o.outputs[0].token_ids, expected, margins, near_tie)
        llm.shutdown()


@two_gpus
def test_cuda_tensor_parallel_nccl_equals_one_gpu(tiny_llama_dir):
    """TP=2 over two GPUs (NCCL all-reduce and logits all-gather): float32 tokens and logprobs = one GPU's."""
    kw = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    got = {}
    for tp in (1, 2):
        llm = LLM(tiny_llama_dir, tensor_parallel_size=tp, **kw)
        try:
            res = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
            got[tp] = [
                (
                    o.outputs[0].token_ids,
                    [max(d.values(), key=lambda x: x.logprob).logprob for d in o.outputs[0].logprobs],
                )
                for o in res
            ]
        finally:
            llm.shutdown()
    for (t1, l1), (t2, l2) in zip(got[1], got[2]):
        assert t1 == t2 and l1 == pytest.approx(l2, abs=1e-3)


@gpu
def test_tensor_parallel_on_too_few_gpus_is_refused(tiny_llama_dir):
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here")
    with pytest.raises(ValueError, match="tensor-parallel-size 2 on GPUs takes GPUs 0..1"):
        LLM(tiny_llama_dir, device="cuda", tensor_parallel_size=2)


@gpu
def test_cuda_engine_features_equal_cpu(tiny_llama_dir):
    """Chunked prefill, prefix hits, logprobs, preemption and int8 KV on cuda = the CPU engine (float32)."""
    cpu = _scenarios(tiny_llama_dir, device="cpu")
    cuda = _scenarios(tiny_llama_dir, device="cuda", enforce_eager=True)
    for name in ("chunked", "prefix_hits", "logprobs", "preempted", "int8_kv"):
        assert cuda[name] == cpu[name], name
    assert cuda["int8_logprobs"] == pytest.approx(cpu["int8_logprobs"], abs=5e-2)
    for a, b in zip(cuda["logprob_values"], cpu["logprob_values"]):
        assert a == pytest.approx(b, abs=1e-3)


@gpu
def test_cuda_graphs_padded_buckets_equal_eager(tiny_llama_dir):
    got = _graph_buckets(tiny_llama_dir)
    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    res = llm.generate(prompt_token_ids=PROMPTS[:3] + PROMPTS[:2], sampling_params=GREEDY, use_tqdm=False)
    assert got["graph_buckets"] == [o.outputs[0].token_ids for o in res]
    assert 5 in got["graph_rows"]


@gpu
def test_cuda_sampling_seeds_grammar_logprobs(tiny_llama_dir):
    from tokenmill.sampling_params import GuidedDecodingParams

    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=8)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=seeded, use_tqdm=False)
    mixed = llm.generate(
        prompt_token_ids=[PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        sampling_params=[
            SamplingParams(max_tokens=10, temperature=0.8),
            seeded,
            SamplingParams(max_tokens=10, repetition_penalty=1.3),
        ],
        use_tqdm=False,
    )
    assert alone[0].outputs[0].token_ids == mixed[1].outputs[0].token_ids
    guided = SamplingParams(
        max_tokens=20, temperature=0.0, guided_decoding=GuidedDecodingParams(choice=["hello", "world"])
    )
    out = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=guided, use_tqdm=False)
    assert out[0].outputs[0].text in ("hello", "world")
    cpu = LLM(tiny_llama_dir, device="cpu", dtype="float32", kv_cache_memory=0.02)
    lp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    a = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=lp, use_tqdm=False)[0].outputs[0]
    b = cpu.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=lp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert sorted(x) == sorted(y)
        for t in x:
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-3)


@gpu
def test_cuda_kv_sizing_from_memory_utilization(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        small = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.2)
    assert "GPU memory:" in caplog.text and "CUDA graphs: captured" in caplog.text
    big = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.4, enforce_eager=True)
    assert big.engine.config.cache.num_blocks > small.engine.config.cache.num_blocks > 1000
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=0.0)


@gpu
def test_cuda_server_streams_with_openai_client(tiny_llama_dir):
    openai = pytest.importorskip("openai")
    from conftest import running_server

    with running_server(tiny_llama_dir, device="cuda", kv_cache_memory=None, gpu_memory_utilization=0.3) as (srv, _):
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            stream = client.completions.create(
                model=tiny_llama_dir, prompt="hello", max_tokens=8, stream=True, temperature=0
            )
            text = "".join(c.choices[0].text for c in stream)
            plain = client.completions.create(model=tiny_llama_dir, prompt="hello", max_tokens=8, temperature=0)
    assert text == plain.choices[0].text
