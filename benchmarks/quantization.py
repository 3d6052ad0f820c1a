"""Weight-only quantization against bfloat16 weights: quality, memory and speed, one run.

    python benchmarks/quantization.py       # SmolLM2 (the packaged Q4_1 GGUF): bf16 | gguf | int8 | int4

Variants: bf16 (the GGUF dequantized to bfloat16, the default), fp32 (the same in float32; quality
only, as the scale of bf16's own rounding), gguf (--quantization gguf: the
file's Q4_1 linear blocks and Q8_0 embedding kept as they are), int8 and int4 (--quantization
int8|int4: the bf16 weights quantized at load time, groups of 32; the lm_head stays int8).
Quality: the 32 chat prompts of benchmarks/variants.py, greedy, against bf16. Speed: batch-1
TPOT and offline output throughput (64 x 256 in x 128 out; `--concurrency 8,32`: 8 and 32
requests at once instead), variants alternating, medians.
Note: SmolLM2's weights ship as Q4_1, so bf16 here is already 4-bit-derived; re-quantizing them
costs less than quantizing an original bf16 checkpoint would.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from variants import (
    add_workload_args,
    agreement,
    alternating_throughput,
    chat_outputs,
    describe_agreement,
    write_result,
)

from tokenmill import LLM
from tokenmill.bench.offline import measure_latency, wait_for_kv_cache

# name -> (dtype, --quantization). fp32 is in the quality table only: how far plain bf16 is from
# full precision puts the quantized variants' distance from bf16 in scale.
VARIANTS = {
    "bf16": ("bfloat16", None),
    "gguf": ("bfloat16", "gguf"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "fp32": ("float32", None),
}


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.core.runner.model
    seen, total = set(), 0
    # bf16 panels (PackedLinear.panels) live in the weight arena, not among parameters or buffers
    panels = [(n, m.panels) for n, m in model.named_modules() if isinstance(getattr(m, "panels", None), torch.Tensor)]
    for name, t in list(model.named_parameters()) + list(model.named_buffers()) + panels:
        key = t.data_ptr() if t.layout == torch.strided else id(t)  # oneDNN-packed weights are opaque
        if name.startswith("rope") or key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, "benchmarks/results/quantization.json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated request counts for the throughput runs (default: --num-prompts)",
    )
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    llms = {
        n: LLM(
            args.model,
            dtype=VARIANTS[n][0],
            quantization=VARIANTS[n][1],
            kv_cache_memory=2.0,
            enable_prefix_caching=False,
        )
        for n in names
    }
    for llm in llms.values():  # timings of the steady state, not of start-up
        wait_for_kv_cache(llm)
    result: dict = {"args": vars(args), "weight_bytes": {n: weight_bytes(llm) for n, llm in llms.items()}}
    outs = {n: chat_outputs(llm, args.max_tokens) for n, llm in llms.items()}
    result["quality_vs_bf16"] = {n: agreement(outs["bf16"], outs[n], args.max_tokens) for n in names if n != "bf16"}
    for n, q in result["quality_vs_bf16"].items():
        print(
            f"quality {n:5} vs bf16 ({q['prompts']} prompts x {q['max_tokens']} greedy tokens): "
            f"{describe_agreement(q)}",
            flush=True,
        )
    for n, b in result["weight_bytes"].items():
        print(f"weights {n:5}: {b / 1e6:7.1f} MB ({b / result['weight_bytes'][names[0]]:.2f}x)")
    names = [n for n in names if n != "fp32"]
    llms.pop("fp32", None)
    if not args.skip_speed:
        tpot: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(args.repeats):
            for n in names:
                tpot[n].append(measure_latency(llms[n], 256, 64, 1, seed=rep)["tpot_s"])
        med_tpot = {n: statistics.median(v) for n, v in tpot.items()}
        result["speed"] = {"batch1_tpot_s": tpot, "median_batch1_tpot_s": med_tpot, "throughput": {}}
        for n in names:
            print(
                f"speed {n:5}: batch-1 TPOT {med_tpot[n] * 1e3:6.2f} ms ({med_tpot[names[0]] / med_tpot[n]:.2f}x), "
                f"median of {args.repeats}",
                flush=True,
            )
        for count in (int(c) for c in (args.concurrency or str(args.num_prompts)).split(",")):
            thr = alternating_throughput(
                {n: llms[n] for n in names}, count, args.input_len, args.output_len, args.repeats
            )
            med_thr = {n: statistics.median(v) for n, v in thr.items()}
            result["speed"]["throughput"][count] = {"tok_s": thr, "median_tok_s": med_thr}
            for n in names:
                print(
                    f"speed {n:5}: {count} x {args.input_len} in x {args.output_len} out {med_thr[n]:7.1f} "
                    f"output tok/s ({med_thr[n] / med_thr[names[0]]:.2f}x), median of {args.repeats}",
                    flush=True,
                )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
