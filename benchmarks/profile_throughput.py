#!/usr/bin/env python
"""Profile tokenmill on the throughput.py workload: where the time goes, by step kind and by op.

    python benchmarks/profile_throughput.py                     # 64 x 256 in x 128 out, bf16
    python benchmarks/profile_throughput.py --dtype float32
    python benchmarks/profile_throughput.py --quantization w8a8
    python benchmarks/profile_throughput.py --trace /tmp/decode-trace.json
    python benchmarks/profile_throughput.py --num-prompts 128 --concurrency 32   # a serving client's closed loop

Two passes over the same workload, driving the engine step by step:
 1. unprofiled, timing every step: the share of the wall time in prompt (prefill) steps,
    pure decode steps, and outside the model runner (scheduler, output processing);
 2. torch.profiler over a few prefill steps and a window of decode steps (profiling a
    whole run takes tens of GB): the top ops by self CPU time, as a share of the
    profiled steps' time.
It also prints the CPU the rest of the (shared) machine used meanwhile: figures taken
while others use CPU are not representative. For Python-level stacks use py-spy:
    py-spy record -r 100 -f raw -o /tmp/p.txt -- python benchmarks/throughput.py --systems tokenmill --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import CpuMeter, cpu_note, make_prompts, special_token_ids, wait_idle  # noqa: E402


class StepTimer:
    """Wraps ModelRunner.execute to record each step's shape and the runner's time."""

    def __init__(self, runner):
        self.runner, self.inner = runner, runner.execute
        self.last: dict = {}
        runner.execute = self

    def __call__(self, sched):
        n_tok = sum(s.num_new_tokens for s in sched.scheduled)
        n_dec = sum(1 for s in sched.scheduled if s.num_new_tokens == 1)
        t0 = time.perf_counter()
        out = self.inner(sched)
        self.last = {
            "tokens": n_tok,
            "decode_rows": n_dec,
            "prefill_tokens": n_tok - n_dec,
            "rows": len(sched.scheduled),
            "runner_s": time.perf_counter() - t0,
        }
        return out


class _LabeledKernels:
    """Stands in for the engine's C++ kernel module (pybind functions the profiler cannot see)
    and wraps every call in a record_function named tm_cpp::<function>."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        from torch.profiler import record_function

        fn = getattr(self._module, name)
        if not callable(fn):
            return fn

        def call(*a, **k):
            with record_function(f"tm_cpp::{name}"):
                return fn(*a, **k)

        setattr(self, name, call)
        return call


def label_cpp_kernels(runner) -> bool:
    """Make the engine's C++ kernels visible by name in torch.profiler (profiling only)."""
    try:
        from tokenmill.kernels import cpu_kernels
    except ImportError:
        return False
    mod = cpu_kernels._module if getattr(cpu_kernels, "_module", None) is not None else None
    if mod is None:
        return False
    proxy = _LabeledKernels(mod)
    cpu_kernels._module = proxy
    attn = getattr(runner, "attn", None)
    if attn is not None and getattr(attn, "kernels", None) is mod:
        attn.kernels = proxy
    return True


def add_all(llm, prompts, sp):
    for p in prompts:
        llm.engine.add_request(None, p, sp)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="HF folder or .gguf file; default: built-in SmolLM2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, help="int4 | int8 | gguf | w8a8 (default: none)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--num-prompts", "-n", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="pass 1: keep this many requests in flight, adding one as one finishes (default: all at once)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=4.0)
    p.add_argument("--prefill-steps", type=int, default=2, help="prefill steps to profile (pass 2)")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps to profile, from the middle of decoding")
    p.add_argument("--top", type=int, default=20, help="ops to list")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the decode window to this path")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each pass, wait up to this long for other processes to go quiet",
    )
    args = p.parse_args(argv)

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, AutoTokenizer

    from tokenmill import LLM, SamplingParams
    from tokenmill.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    cfg, tok = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    vocab = min(cfg.vocab_size, len(tok))
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, special_token_ids(tok), args.seed)
    llm = LLM(
        path,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=threads,
        enable_prefix_caching=False,
        quantization=args.quantization,
    )  # pass 2 repeats pass 1's prompts
    torch.set_num_threads(threads)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(
        prompt_token_ids=prompts[:4], sampling_params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    eng = llm.engine
    timer = StepTimer(eng.core.runner)
    labeled = label_cpp_kernels(eng.core.runner)
    print(
        f"{args.dtype}, {threads} threads, {args.num_prompts} x {args.input_len} in x {args.output_len} out"
        f"{'; C++ kernels shown as tm_cpp::<name>' if labeled else ''}"
    )

    # ---- pass 1: unprofiled, every step timed --------------------------------------------
    wait_idle(args.wait_idle, 0.2, "pass 1")
    # A closed loop (--concurrency): a new request each time one finishes, as a serving client
    # at that concurrency sends them; default: every prompt at once.
    pending = list(prompts)
    add_all(llm, pending[: args.concurrency or len(pending)], sp)
    del pending[: args.concurrency or len(pending)]
    steps = []
    with CpuMeter(threads) as m:
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = eng.step()
            steps.append(dict(timer.last, step_s=time.perf_counter() - t0))
            finished = sum(1 for o in outs if o.finished)
            add_all(llm, pending[:finished], sp)
            del pending[:finished]
    n_out = args.num_prompts * args.output_len
    print(f"pass 1 (unprofiled): {m.wall:.2f} s, {n_out / m.wall:.1f} output tok/s, {len(steps)} steps {cpu_note(m)}")
    pre = [s for s in steps if s["prefill_tokens"]]
    dec = [s for s in steps if not s["prefill_tokens"]]
    for name, group in (("steps with prompt tokens", pre), ("pure decode steps", dec)):
        if not group:
            continue
        t = sum(s["step_s"] for s in group)
        toks = sum(s["tokens"] for s in group)
        print(
            f"  {name:<26} {len(group):4d} steps {t:7.2f} s {100 * t / m.wall:5.1f}%  "
            f"median {1e3 * statistics.median(s['step_s'] for s in group):7.1f} ms/step, {toks} tokens, "
            f"{toks / t:7.1f} tok/s, median batch {statistics.median(s['rows'] for s in group):.0f} rows"
        )
    outside = sum(s["step_s"] - s["runner_s"] for s in steps)
    print(f"  outside the model runner (scheduler, output processing): {outside:.2f} s {100 * outside / m.wall:.1f}%")
    print(f"  between steps (LLM loop): {m.wall - sum(s['step_s'] for s in steps):.2f} s")

    # ---- pass 2: profile a few prefill steps and a decode window -------------------------
    wait_idle(args.wait_idle, 0.2, "pass 2")
    add_all(llm, prompts, sp)
    acts = [ProfilerActivity.CPU]
    prof_pre = profile(activities=acts, acc_events=True)
    prof_dec = profile(activities=acts, acc_events=True)
    n_pre = n_dec = 0
    dec_seen = 0
    dec_start = max(0, len(dec) // 2 - args.decode_steps // 2)
    t_pre = t_dec = 0.0
    while eng.has_unfinished_requests():
        # Peek: will this step carry prompt tokens? (waiting requests or unfinished prompts)
        sch = eng.core.scheduler
        has_prompt = bool(getattr(sch, "waiting", None)) or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in getattr(sch, "running", [])
        )
        prof = None
        if has_prompt and n_pre < args.prefill_steps:
            prof, n_pre = prof_pre, n_pre + 1
        elif not has_prompt:
            if dec_start <= dec_seen < dec_start + args.decode_steps:
                prof, n_dec = prof_dec, n_dec + 1
            dec_seen += 1
        if prof is not None:
            prof.start()
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            prof.stop()
            if prof is prof_pre:
                t_pre += dt
            else:
                t_dec += dt
        else:
            eng.step()
    for label, prof, n, t in (("prefill", prof_pre, n_pre, t_pre), ("decode", prof_dec, n_dec, t_dec)):
        if not n:
            continue
        ka = [e for e in prof.key_averages()]
        rows = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"\n{label}: {n} profiled steps, {t:.2f} s (profiler on); top ops by self CPU time")
        print(f"  {'op':<46} {'self ms':>9} {'share':>7} {'calls':>7} {'us/call':>9}")
        for e in rows[: args.top]:
            print(
                f"  {e.key[:46]:<46} {e.self_cpu_time_total / 1e3:9.1f} {100 * e.self_cpu_time_total / (t * 1e6):6.1f}% "
                f"{e.count:>7} {e.self_cpu_time_total / max(e.count, 1):9.1f}"
            )
        ops = sum(e.self_cpu_time_total for e in rows)
        print(
            f"  {'(all of the above kinds)':<46} {ops / 1e3:9.1f} {100 * ops / (t * 1e6):6.1f}%  "
            f"(the rest: Python{'' if labeled else ' and any kernels torch.profiler cannot see'})"
        )
    if args.trace and n_dec:
        prof_dec.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")


if __name__ == "__main__":
    main()
