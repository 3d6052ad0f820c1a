#!/usr/bin/env python
"""Offline throughput: tokenmill against Hugging Face transformers, same run, same machine.

Workload: N seeded random-token prompts of a fixed input length, each generating exactly a
fixed number of output tokens (greedy, EOS ignored). Three systems run it on the same
model folder, dtype and torch thread count:

  tokenmill   LLM.generate over all prompts at once (continuous batching), --repeats
              timed runs, median reported
  hf-serial   transformers generate one prompt at a time, timed on the first
              --hf-serial-prompts prompts (a rate, since it is slow)
  hf-static   transformers generate over static batches of --hf-batch-size prompts
              (left padding, attention mask, min_new_tokens = max_new_tokens)

Each system is warmed up with a short run before it is timed. The script prints output
tokens/s for each, the ratios tokenmill / hf-serial and tokenmill / hf-static, and writes a
JSON result (config, machine facts, figures).

    python benchmarks/throughput.py                      # SmolLM2, 64 x 256 in x 128 out, bf16
    python benchmarks/throughput.py --dtype float32
    python benchmarks/throughput.py --systems tokenmill  # engine only (e.g. under py-spy)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SYSTEMS = ("tokenmill", "hf-serial", "hf-static")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


# --------------------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------------------
def special_token_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids or [])
    for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(tok, "special", True):
            ids.add(int(tid))
    return ids


def make_prompts(n: int, input_len: int, vocab_size: int, excluded: set[int], seed: int) -> list[list[int]]:
    """n prompts of input_len token ids drawn uniformly (seeded) from the vocabulary minus `excluded`."""
    allowed = torch.tensor([i for i in range(vocab_size) if i not in excluded], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(allowed), (n, input_len), generator=g)
    return allowed[idx].tolist()


# --------------------------------------------------------------------------------------
# systems
# --------------------------------------------------------------------------------------
def run_tokenmill(llm, prompts: list[list[int]], output_len: int, threads: int) -> tuple[CpuMeter, list[list[int]]]:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with CpuMeter(threads) as m:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    return m, [list(o.outputs[0].token_ids) for o in outs]


def hf_generate_batch(model, prompts: list[list[int]], output_len: int, pad_id: int) -> list[list[int]]:
    """One transformers generate call over `prompts` (left-padded); returns the new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def run_hf(
    model, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int, threads: int
) -> tuple[CpuMeter, list[list[int]]]:
    results: list[list[int]] = []
    with CpuMeter(threads) as m:
        for i in range(0, len(prompts), batch_size):
            results.extend(hf_generate_batch(model, prompts[i : i + batch_size], output_len, pad_id))
    return m, results


# --------------------------------------------------------------------------------------
# facts and helpers
# --------------------------------------------------------------------------------------
def machine_facts(threads: int) -> dict:
    import transformers

    cpu_model, flags = None, ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu_model is None:
                    cpu_model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1]
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parent,
                timeout=5,
            ).stdout.strip()
            or None
        )
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "src"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parent,
                timeout=5,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "amx": "amx_tile" in flags,
        "avx512": "avx512f" in flags,
        "memory_gib": mem_gib,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "git_commit": commit,
        "git_src_dirty": dirty,  # uncommitted changes under src/ when the run started
    }


def _system_busy_s() -> tuple[float, float] | None:
    """(CPU seconds all processes spent busy since boot, of which at a positive nice level),
    from /proc/stat; None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    tck = os.sysconf("SC_CLK_TCK")
    return (sum(v[:8]) - idle) / tck, v[1] / tck


class CpuMeter:
    """Wall time, this process's CPU time, and the CPU the rest of the machine used meanwhile:
    the machine is shared, so every timing carries how much CPU it actually got."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        self.w0, self.p0, self.s0 = time.perf_counter(), time.process_time(), _system_busy_s()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.own = time.process_time() - self.p0
        s1 = _system_busy_s()
        if s1 is None or self.s0 is None:
            self.others = self.niced = None
        else:  # niced: background work (nice > 0) that mostly yields to this process
            self.niced = max(0.0, s1[1] - self.s0[1])
            self.others = max(0.0, s1[0] - self.s0[0] - self.own - self.niced)
        return False

    def facts(self) -> dict:
        w = max(self.wall, 1e-9)
        return {
            "own_cpu_util": round(self.own / (w * self.threads), 2),
            "others_cpu_cores": None if self.others is None else round(self.others / w, 2),
            "niced_cpu_cores": None if self.niced is None else round(self.niced / w, 2),
        }


def wait_idle(max_wait_s: float, threshold: float, label: str) -> None:
    """Wait (up to max_wait_s) until other processes use less than `threshold` CPU cores,
    sampled over 2 s windows while this process sleeps; niced background work is not counted."""
    if max_wait_s <= 0:
        return
    deadline = time.monotonic() + max_wait_s
    waited = False
    while True:
        b0, t0 = _system_busy_s(), time.perf_counter()
        time.sleep(2.0)
        b1 = _system_busy_s()
        if b0 is None or b1 is None:
            return
        busy = ((b1[0] - b1[1]) - (b0[0] - b0[1])) / (time.perf_counter() - t0)  # niced work yields to us
        if busy < threshold:
            if waited:
                print(f"  machine idle enough for {label} (others {busy:.2f} cores)")
            return
        if time.monotonic() > deadline:
            print(f"  gave up waiting for an idle machine before {label} (others {busy:.2f} cores)")
            return
        if not waited:
            print(f"  waiting for other processes to go quiet before {label} (others {busy:.2f} cores) ...")
            waited = True
        time.sleep(3.0)


def cpu_note(m: CpuMeter) -> str:
    f = m.facts()
    note = f"(own CPU {f['own_cpu_util']:.0%} of {m.threads} threads"
    if f["others_cpu_cores"] is not None:
        note += f", other processes {f['others_cpu_cores']:.2f} cores"
        if f["niced_cpu_cores"]:
            note += f" + {f['niced_cpu_cores']:.2f} niced"
    return note + ")"


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def matmul_flops_per_token(hf_config) -> tuple[float, float]:
    """(FLOPs per token through the decoder layers, FLOPs per token through the LM head);
    attention score/value products excluded (small next to the weights at these lengths)."""
    c = hf_config
    h, inter, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    per_layer = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 3 * h * inter
    return 2.0 * layers * per_layer, 2.0 * h * vocab


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many rows are identical, and the mean common prefix length (greedy sanity check)."""
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    return {
        "rows": len(prefix),
        "identical_rows": sum(1 for x, y in zip(a, b) if x == y),
        "mean_common_prefix": round(sum(prefix) / max(len(prefix), 1), 1),
        "first_token_matches": sum(1 for k in prefix if k > 0),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Prints output tokens/s and ratios; writes a JSON result.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    g = p.add_argument_group("model and machine")
    g.add_argument(
        "--model",
        default=None,
        help="HF folder or .gguf file; default: tokenmill's built-in SmolLM2-135M-Instruct "
        "(the HF folder it converts from the packaged GGUF, used by every system)",
    )
    g.add_argument(
        "--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights and activations dtype, all systems"
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for all systems (default: all cores available to this process)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", "-n", type=int, default=64, help="number of prompts")
    w.add_argument("--input-len", type=int, default=256, help="prompt length in tokens")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt (exact: EOS ignored)")
    w.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    w.add_argument(
        "--warmup-output-len",
        type=int,
        default=4,
        help="output tokens of the short warm-up run each system gets before timing",
    )
    s = p.add_argument_group("systems")
    s.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)} to run")
    s.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed tokenmill runs (the median is reported); run 1 uses the peers' prompts, later "
        "runs fresh seeded prompts of the same shape, so none can hit a prefix cache",
    )
    s.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of hf-static")
    s.add_argument(
        "--hf-serial-prompts",
        type=int,
        default=8,
        help="hf-serial is timed on only this many prompts (its tokens/s is a rate over that "
        "subset); 0 or a value >= --num-prompts times all prompts",
    )
    s.add_argument(
        "--hf-attn", default=None, help="transformers attn_implementation (default: transformers' own choice, sdpa)"
    )
    e = p.add_argument_group("tokenmill engine")
    e.add_argument("--max-num-seqs", type=int, default=256, help="tokenmill max_num_seqs")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokenmill max_num_batched_tokens")
    e.add_argument("--kv-cache-memory", type=float, default=4.0, help="tokenmill KV pool in GiB")
    e.add_argument(
        "--quantization",
        default=None,
        choices=["int4", "int8"],
        help="tokenmill weight-only quantization (transformers keeps the checkpoint's weights)",
    )
    s.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each timed run, wait up to this long for other processes on this (shared) "
        "machine to use fewer than --idle-threshold cores; 0: do not wait",
    )
    s.add_argument(
        "--idle-threshold",
        type=float,
        default=0.2,
        metavar="CORES",
        help="CPU cores other processes may use for the machine to count as idle",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out", default=None, help="JSON result path (default: benchmarks/results/throughput-<timestamp>.json)"
    )
    o.add_argument(
        "--no-check",
        action="store_true",
        help="skip comparing tokenmill's greedy outputs with transformers' (informational)",
    )
    args = p.parse_args(argv)
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    bad = [x for x in args.systems if x not in SYSTEMS]
    if bad:
        p.error(f"unknown systems {bad}; choose from {SYSTEMS}")
    for name in ("num_prompts", "input_len", "output_len", "repeats", "hf_batch_size", "warmup_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


# --------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    torch.set_num_threads(threads)
    dtype = DTYPES[args.dtype]

    from transformers import AutoConfig, AutoTokenizer

    from tokenmill.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    hf_config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = min(hf_config.vocab_size, len(tokenizer))
    excluded = special_token_ids(tokenizer)
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, excluded, args.seed)
    warm_prompts = make_prompts(min(4, args.num_prompts), args.input_len, vocab, excluded, args.seed + 1)
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else (hf_config.pad_token_id if hf_config.pad_token_id is not None else hf_config.eos_token_id)
    )
    n_out = args.num_prompts * args.output_len
    layer_flops, head_flops = matmul_flops_per_token(hf_config)
    run_flops = args.num_prompts * ((args.input_len + args.output_len) * layer_flops + args.output_len * head_flops)

    machine = machine_facts(threads)
    out = (
        Path(args.out)
        if args.out
        else (Path(__file__).resolve().parent / "results" / f"throughput-{_dt.datetime.now():%Y%m%d-%H%M%S}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    base = {
        "benchmark": "throughput",
        "timestamp": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"model_path": path, "pad_token_id": pad_id, "excluded_special_ids": len(excluded)},
        "machine": machine,
        "run_matmul_gflop": round(run_flops / 1e9, 1),
    }

    def save_partial() -> None:  # after each system, so an interrupted run still leaves its figures
        out.write_text(json.dumps(base | {"partial": True, "results": results}, indent=2) + "\n")

    print(f"model   {path}  ({hf_config.architectures[0]}, {args.dtype})")
    print(
        f"machine {machine['cpu_model']}  cpus={machine['cpu_count']} threads={threads} "
        f"amx={machine['amx']}  torch {machine['torch']}  transformers {machine['transformers']}"
    )
    print(
        f"workload {args.num_prompts} prompts x {args.input_len} in x {args.output_len} out "
        f"(seed {args.seed}; {len(excluded)} special ids excluded), greedy, EOS ignored; load avg {loadavg()}"
    )

    results: dict = {}
    outputs: dict[str, list[list[int]]] = {}

    # ---- tokenmill --------------------------------------------------------------------
    if "tokenmill" in args.systems:
        from tokenmill import LLM

        t0 = time.perf_counter()
        llm = LLM(
            path,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory,
            num_threads=threads,
            quantization=args.quantization,
        )
        load_s = time.perf_counter() - t0
        torch.set_num_threads(threads)
        warm, _ = run_tokenmill(llm, warm_prompts, args.warmup_output_len, threads)
        runs, cpu = [], []
        for r in range(args.repeats):
            wait_idle(args.wait_idle, args.idle_threshold, f"tokenmill run {r + 1}")
            # Run 1 gets the prompts the peers get (its outputs are compared with theirs); later
            # runs get fresh prompts of the same shape, so no run can hit a prefix cache.
            run_prompts = (
                prompts
                if r == 0
                else make_prompts(args.num_prompts, args.input_len, vocab, excluded, args.seed + 1000 + r)
            )
            m, outs = run_tokenmill(llm, run_prompts, args.output_len, threads)
            bad = [len(o) for o in outs if len(o) != args.output_len]
            if bad:
                raise RuntimeError(f"tokenmill produced {len(bad)} rows of the wrong length, e.g. {bad[:3]}")
            if r == 0:
                outputs["tokenmill"] = outs
            runs.append(m.wall)
            cpu.append(m.facts())
            print(
                f"  tokenmill run {r + 1}/{args.repeats}: {m.wall:.2f} s  {n_out / m.wall:.1f} output tok/s  {cpu_note(m)}"
            )
        med = statistics.median(runs)
        results["tokenmill"] = {
            "load_s": round(load_s, 2),
            "warmup_s": round(warm.wall, 2),
            "runs_s": [round(x, 3) for x in runs],
            "runs_cpu": cpu,
            "time_s": round(med, 3),
            "prompts": args.num_prompts,
            "output_tokens": n_out,
            "output_tok_s": round(n_out / med, 1),
            "total_tok_s": round(args.num_prompts * (args.input_len + args.output_len) / med, 1),
            "matmul_gflop_s": round(run_flops / med / 1e9, 1),
        }
        save_partial()
        del llm
        gc.collect()

    # ---- transformers -----------------------------------------------------------------
    hf_systems = [s for s in args.systems if s.startswith("hf-")]
    if hf_systems:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        kw = {"attn_implementation": args.hf_attn} if args.hf_attn else {}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
        load_s = time.perf_counter() - t0
        torch.set_num_threads(threads)
        attn_impl = getattr(model.config, "_attn_implementation", None)

        if "hf-serial" in hf_systems:
            k = args.hf_serial_prompts
            k = args.num_prompts if k <= 0 or k >= args.num_prompts else k
            warm, _ = run_hf(model, warm_prompts[:1], args.warmup_output_len, 1, pad_id, threads)
            wait_idle(args.wait_idle, args.idle_threshold, "hf-serial")
            m, outs = run_hf(model, prompts[:k], args.output_len, 1, pad_id, threads)
            dt = m.wall
            outputs["hf-serial"] = outs
            toks = k * args.output_len
            results["hf-serial"] = {
                "load_s": round(load_s, 2),
                "warmup_s": round(warm.wall, 2),
                "time_s": round(dt, 3),
                **m.facts(),
                "prompts": k,
                "output_tokens": toks,
                "subset": k < args.num_prompts,
                "output_tok_s": round(toks / dt, 1),
                "total_tok_s": round(k * (args.input_len + args.output_len) / dt, 1),
                "est_time_all_prompts_s": round(dt * args.num_prompts / k, 1),
                "attn_implementation": attn_impl,
            }
            print(f"  hf-serial: {dt:.2f} s for {k} prompts  {toks / dt:.1f} output tok/s  {cpu_note(m)}")
            save_partial()

        if "hf-static" in hf_systems:
            bs = args.hf_batch_size
            warm, _ = run_hf(
                model, (warm_prompts * bs)[: min(bs, args.num_prompts)], args.warmup_output_len, bs, pad_id, threads
            )
            wait_idle(args.wait_idle, args.idle_threshold, "hf-static")
            m, outs = run_hf(model, prompts, args.output_len, bs, pad_id, threads)
            dt = m.wall
            bad = [len(o) for o in outs if len(o) != args.output_len]
            if bad:
                raise RuntimeError(f"hf-static produced {len(bad)} rows of the wrong length")
            outputs["hf-static"] = outs
            results["hf-static"] = {
                "load_s": round(load_s, 2),
                "warmup_s": round(warm.wall, 2),
                "time_s": round(dt, 3),
                **m.facts(),
                "prompts": args.num_prompts,
                "batch_size": bs,
                "output_tokens": n_out,
                "output_tok_s": round(n_out / dt, 1),
                "total_tok_s": round(args.num_prompts * (args.input_len + args.output_len) / dt, 1),
                "matmul_gflop_s": round(run_flops / dt / 1e9, 1),
                "attn_implementation": attn_impl,
            }
            print(f"  hf-static (batch {bs}): {dt:.2f} s  {n_out / dt:.1f} output tok/s  {cpu_note(m)}")
        del model
        gc.collect()

    # ---- ratios, agreement, report ----------------------------------------------------
    ratios = {}
    if "tokenmill" in results:
        for peer in ("hf-serial", "hf-static"):
            if peer in results:
                ratios[f"tokenmill/{peer}"] = round(
                    results["tokenmill"]["output_tok_s"] / results[peer]["output_tok_s"], 2
                )
    checks = {}
    if not args.no_check and "tokenmill" in outputs:
        for peer in ("hf-serial", "hf-static"):
            if peer in outputs:
                checks[f"tokenmill_vs_{peer}"] = agreement(outputs["tokenmill"][: len(outputs[peer])], outputs[peer])
    total_s = time.perf_counter() - t_start

    print()
    print(f"{'system':<12} {'output tok/s':>13} {'total tok/s':>12} {'time s':>8} {'others':>6}  notes")
    contended = False
    for name in SYSTEMS:
        if name not in results:
            continue
        r = results[name]
        note = ""
        if name == "tokenmill":
            note = f"median of {args.repeats} runs {r['runs_s']}, all {r['prompts']} prompts at once"
        elif name == "hf-serial":
            note = (
                f"one prompt at a time; rate measured on {r['prompts']} of {args.num_prompts} prompts "
                f"(all would take ~{r['est_time_all_prompts_s']} s)"
                if r["subset"]
                else "one prompt at a time"
            )
        elif name == "hf-static":
            note = f"static batches of {r['batch_size']}"
        oc = [c["others_cpu_cores"] for c in r.get("runs_cpu", [r])]
        others = max((c for c in oc if c is not None), default=None)
        contended = contended or (others is not None and others > 0.25)
        print(
            f"{name:<12} {r['output_tok_s']:>13.1f} {r['total_tok_s']:>12.1f} {r['time_s']:>8.2f} "
            f"{'-' if others is None else f'{others:.2f}':>6}  {note}"
        )
    print(
        "('others': CPU cores other processes used while the system was timed, worst run; niced "
        "background work, which yields to this process, is not counted but is in the JSON)"
    )
    if contended:
        print("WARNING: other processes used CPU during timing; the figures and ratios are disturbed")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}x")
    for k, v in checks.items():
        print(
            f"greedy agreement {k}: {v['identical_rows']}/{v['rows']} rows identical, "
            f"mean common prefix {v['mean_common_prefix']} of {args.output_len} tokens"
        )
    print(f"total benchmark time {total_s:.1f} s; load avg {loadavg()}")

    result = base | {
        "results": results,
        "ratios": ratios,
        "greedy_agreement": checks,
        "total_benchmark_s": round(total_s, 1),
        "contended": contended,
        "loadavg_end": loadavg(),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
