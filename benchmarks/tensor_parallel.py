#!/usr/bin/env python
"""Tensor parallelism on this machine: the cost of one all-reduce, and what TP does to decode.

    python benchmarks/tensor_parallel.py --parts allreduce          # gloo vs shared memory, per call
    python benchmarks/tensor_parallel.py --parts message            # one step's inputs to a worker
    python benchmarks/tensor_parallel.py --parts engine             # TP=1 vs TP=N, c=1 and c=32
    python benchmarks/tensor_parallel.py --parts allreduce,engine --repeats 3

allreduce: `--world` processes (each pinned to its own core when there are enough) sum a
[rows, hidden] bfloat16 tensor `--calls` times through the engine's TPGroup (comm.py), once with
the gloo process group and once with the shared-memory all-reduce; median microseconds per call,
and what that costs per decode step (two all-reduces per layer).

engine: for each TP size, a fresh process runs LLM(tensor_parallel_size=N) on the model: batch-1
decode (one 128-token prompt, 64 tokens streamed; TPOT = (last - first token time) / 63) and 32
concurrent requests (128 in, 64 out, output tokens/s). Medians of --repeats. A JSON result goes
to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from contention import Others  # noqa: E402


def _allreduce_rank(
    rank: int, world: int, port: int, shm_path: str, backend: str, rows: int, hidden: int, calls: int, out
) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    os.environ["TOKENMILL_TP_ALLREDUCE"] = backend
    from tokenmill.distributed.comm import TPGroup

    g = TPGroup.connect(rank, world, port, shm_path, 8 << 20)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16)
    times = []
    for i in range(calls + 50):
        y = x.clone()
        t0 = time.perf_counter()
        g.all_reduce(y)
        if i >= 50:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times) * 1e6)
    g.close()


def allreduce(world: int, rows_list: list[int], hidden: int, calls: int) -> dict:
    import tempfile

    from tokenmill.distributed.comm import ShmAllReduce
    from tokenmill.worker.executor import _free_port

    ctx = mp.get_context("spawn")
    res = {}
    for backend in ("gloo", "shm"):
        for rows in rows_list:
            fd, path = tempfile.mkstemp(prefix="tokenmill-bench-", dir="/dev/shm")
            os.close(fd)
            ShmAllReduce(path, 0, world, 8 << 20, create=True).close()
            q = ctx.Queue()
            port = _free_port()
            procs = [
                ctx.Process(target=_allreduce_rank, args=(r, world, port, path, backend, rows, hidden, calls, q))
                for r in range(world)
            ]
            with Others([], children=True) as others:
                for p in procs:
                    p.start()
                us = q.get(timeout=600)
                for p in procs:
                    p.join()
            os.unlink(path)
            res[f"{backend} rows={rows}"] = us
            print(
                f"all-reduce {backend:>4}, {world} ranks, [{rows} x {hidden}] bf16: {us:8.1f} us per call "
                f"[other processes: {others.cores:.2f} cores]",
                flush=True,
            )
    return res


def _echo(conn) -> None:
    import pickle

    from tokenmill.worker.executor import _await_message

    while True:
        _await_message(conn)  # as a worker waits for its next step
        msg = conn.recv_bytes()
        if msg == b"stop":
            return
        pickle.loads(msg)
        conn.send_bytes(b"k")


def step_message(rows_list: list[int], calls: int) -> dict:
    """Round trip of one step's inputs to a worker (pickled as the engine does, sent over a pipe,
    the worker polling for it as it does between steps, unpickled) and a one-byte reply that
    wakes the sender: an upper bound on what the broadcast adds to a step."""
    import torch

    from tokenmill.model.layers.attention import AttentionMetadata
    from tokenmill.worker.executor import dumps
    from tokenmill.worker.staging import StepInputs

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,))
    proc.start()
    res = {}
    for rows in rows_list:  # an all-decode step of `rows` requests with 512-token contexts
        meta = AttentionMetadata(
            slot_mapping=torch.arange(rows),
            decode_rows=torch.arange(rows),
            decode_block_tables=torch.arange(rows * 32).view(rows, 32),
            decode_seq_lens=torch.full((rows,), 512),
            all_decode=True,
        )
        step = StepInputs(torch.arange(rows), torch.full((rows,), 511), meta, list(range(rows)))
        times = []
        for i in range(calls + 20):
            t0 = time.perf_counter()
            parent.send_bytes(dumps(step))
            parent.recv_bytes()
            if i >= 20:
                times.append(time.perf_counter() - t0)
        res[f"rows={rows}"] = us = statistics.median(times) * 1e6
        print(f"step message round trip, {rows} decode rows: {us:8.1f} us", flush=True)
    parent.send_bytes(b"stop")
    proc.join()
    return res


def _engine_worker(model: str | None, tp: int, dtype: str) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, enable_prefix_caching=False)
    vocab = llm.engine.config.model.vocab_size
    prompt = [1000 + (7 * j) % (vocab - 1000) for j in range(128)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=8))  # warm-up
    t_first = t_last = None
    t0 = time.perf_counter()
    for _out in llm.stream(prompt, params):
        now = time.perf_counter()
        t_first = t_first or now
        t_last = now
    tpot = (t_last - t_first) / 63 * 1e3
    ttft = (t_first - t0) * 1e3
    prompts = [[1000 + (7 * j + 13 * i) % (vocab - 1000) for j in range(128)] for i in range(32)]
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t0
    llm.shutdown()
    return {"tpot_ms": tpot, "ttft_ms": ttft, "c32_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / dt}


def heads8_model(out: Path = Path("/tmp/tokenmill-bench-smollm2-8heads")) -> str:
    """SmolLM2's shapes (30 layers, hidden 576, MLP 1536, vocab 49152, ~135M parameters) with
    8 query / 4 kv heads of 64 (SmolLM2 has 9 / 3), so that 2 ranks divide them; random bf16
    weights (speed only) and SmolLM2's tokenizer. Built once."""
    if (out / "config.json").exists():
        return str(out)
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenmill.model.loader import resolve_model_path

    smol = resolve_model_path(None)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    for name in os.listdir(smol):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(smol, name), out / name)
    return str(out)


def engine(model: str | None, sizes: list[int], dtype: str, repeats: int) -> dict:
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for r in range(repeats):
        for n in sizes:  # interleaved, so that drifts in the machine's speed hit every size alike
            cmd = [sys.executable, __file__, "--engine-worker", str(n), "--dtype", dtype]
            if model:
                cmd += ["--model", model]
            with Others([], children=True) as others:  # CPU that other processes took meanwhile (contention.py)
                proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"TP={n} failed:\n{proc.stderr[-3000:]}")
            runs[n].append({**json.loads(line[7:]), "others_cores": others.cores})
            print(f"round {r + 1} TP={n}: {runs[n][-1]}", flush=True)
    summary = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in runs.items()}
    base = summary[sizes[0]]
    for n, s in summary.items():
        print(
            f"TP={n}: batch-1 TPOT {s['tpot_ms']:.2f} ms (x{s['tpot_ms'] / base['tpot_ms']:.2f}), TTFT "
            f"{s['ttft_ms']:.1f} ms, 32 concurrent {s['c32_tok_s']:.0f} tok/s (x{s['c32_tok_s'] / base['c32_tok_s']:.2f})"
            f"  [other processes: {s['others_cores']:.2f} cores]"
        )
    return {"runs": runs, "summary": summary}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="allreduce,message,engine")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rows", default="1,32,512")
    p.add_argument("--hidden", type=int, default=576, help="SmolLM2's hidden size")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument(
        "--model",
        default=None,
        help="default: the built-in SmolLM2; smollm2-8heads: its shapes with 8 / 4 heads (TP=2 divides)",
    )
    p.add_argument("--sizes", default="1,3", help="TP sizes (SmolLM2's heads divide by 1 and 3)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engine-worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.engine_worker is not None:
        print("RESULT " + json.dumps(_engine_worker(args.model, args.engine_worker, args.dtype)), flush=True)
        return
    result = {"cpus": os.cpu_count(), "argv": sys.argv[1:]}
    parts = args.parts.split(",")
    if "allreduce" in parts:
        result["allreduce_us"] = allreduce(args.world, [int(r) for r in args.rows.split(",")], args.hidden, args.calls)
    if "message" in parts:
        result["step_message_us"] = step_message([int(r) for r in args.rows.split(",")], args.calls // 4)
    if args.model == "smollm2-8heads":
        args.model = heads8_model()
    if "engine" in parts:
        result["engine"] = engine(args.model, [int(n) for n in args.sizes.split(",")], args.dtype, args.repeats)
    out = Path(args.out or Path(__file__).parent / "results" / f"tensor-parallel-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
