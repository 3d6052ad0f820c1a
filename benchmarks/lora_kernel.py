#!/usr/bin/env python
"""Multi-LoRA op (csrc/lora.cpp: lora_add) against the base linear (panel_linear) of the same layer.

    python benchmarks/lora_kernel.py                       # SmolLM2's qkv / gate_up / down, rank 16
    python benchmarks/lora_kernel.py --rows 1,32 --slots 1,16 --rank 64
    python benchmarks/lora_kernel.py --fused --rows 1,8,32      # the whole fused decode step

For each layer shape (30 copies of the weights and of the adapters' slot buffers, so that they
come from memory as in a decode step), batch size and number of distinct adapters in the batch
(rows spread over them round-robin, out of --max-slots slots), the two ops run interleaved
(`--repeats` times each); prints the median time per layer of each and LoRA's cost relative to
the base linear. --fused: SmolLM2's fused decode step (csrc/decode_step.cpp) on a real decode
batch, with adapters on all four linears of every layer against the same step without
(row_slots=None), interleaved; prints median milliseconds and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from panel_linear import time_interleaved  # benchmarks/ is on sys.path when run as a script

# name: (K, slice bounds), SmolLM2-135M
SHAPES = {"qkv": (576, [0, 576, 768, 960]), "gate_up": (576, [0, 1536, 3072]), "down": (1536, [0, 576])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32,256", help="batch sizes (comma-separated)")
    p.add_argument("--slots", default="1,4,16", help="distinct adapters in the batch (comma-separated)")
    p.add_argument("--max-slots", type=int, default=16, help="slots in the buffers")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--copies", type=int, default=30, help="copies of each layer (weights from memory)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--fused", action="store_true", help="time the fused decode step instead (SmolLM2)")
    p.add_argument("--context", type=int, default=256, help="--fused: prompt tokens per row")
    args = p.parse_args(argv)
    if args.fused:
        return fused_step(args)
    from tokenmill.kernels import cpu_kernels

    k = cpu_kernels.load()
    if k is None or not hasattr(k, "lora_add") or not hasattr(k, "panel_linear"):
        raise SystemExit("the C++ kernels (with AVX512-BF16 or AVX2 + FMA) are unavailable")
    S, r, copies = args.max_slots, args.rank, args.copies
    print(
        f"{torch.get_num_threads()} threads; rank {r}, {S} slots; microseconds per layer, medians of "
        f"{args.repeats} interleaved runs"
    )
    for name, (K, bounds) in SHAPES.items():
        N, ns = bounds[-1], len(bounds) - 1
        panels = [k.pack_panels((torch.randn(N, K) / K**0.5).bfloat16()) for _ in range(copies)]
        loras = [
            (
                (torch.randn(S, ns, r, K) / K**0.5).bfloat16(),
                (torch.randn(S, r, N) / r**0.5).bfloat16(),
                torch.full((S, ns), r, dtype=torch.int32),
                torch.tensor(bounds),
            )
            for _ in range(copies)
        ]
        for M in (int(v) for v in args.rows.split(",")):
            x = torch.randn(M, K).bfloat16()
            y = torch.zeros(M, N, dtype=torch.bfloat16)
            for d in sorted({min(int(v), M) for v in args.slots.split(",")}):
                row_slots = (torch.arange(M) % d).to(torch.int32)
                runs = {
                    "base": lambda: [k.panel_linear(x, w, N) for w in panels],
                    "lora": lambda: [k.lora_add(y, x, *lw, row_slots) for lw in loras],
                }
                times = time_interleaved(runs, args.repeats, copies)
                base, lora = times["base"], times["lora"]
                print(
                    f"{name:8s} rows {M:4d} adapters {d:3d}: base {base * 1e6:8.1f}  lora_add {lora * 1e6:7.1f}  "
                    f"lora / base {lora / base:6.1%}"
                )


def lora_specs(model, slots: int, rank: int) -> list:
    """Random adapters on every qkv, o, gate_up and down (each slot at full rank)."""
    specs = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, hidden = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.qkv_proj.in_features
        for K, bounds in (
            (hidden, [0, q, q + kv, q + 2 * kv]),
            (q, [0, hidden]),
            (hidden, [0, mlp.intermediate, 2 * mlp.intermediate]),
            (mlp.intermediate, [0, hidden]),
        ):
            N, ns = bounds[-1], len(bounds) - 1
            specs.append(
                (
                    (torch.randn(slots, ns, rank, K) / K**0.5).bfloat16(),
                    (torch.randn(slots, rank, N) * 0.1 / rank**0.5).bfloat16(),
                    torch.full((slots, ns), rank, dtype=torch.int32),
                    torch.tensor(bounds),
                )
            )
    return specs


def fused_step(args) -> None:
    from decode_step import capture_step

    from tokenmill import LLM

    llm = LLM(None, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=256, kv_cache_memory=0.5)
    runner = llm.engine.core.runner
    fd = runner.fast_decode
    if fd is None or not hasattr(fd, "set_lora"):
        raise SystemExit("the fused decode step is off here (see the log)")
    fd.set_lora(lora_specs(runner.model, args.max_slots, args.rank))
    print(
        f"{torch.get_num_threads()} threads; rank {args.rank} on qkv, o, gate_up, down of every layer; "
        f"{args.context}-token prompts; milliseconds, medians of {args.repeats} interleaved runs"
    )
    for M in (int(v) for v in args.rows.split(",")):
        ids, pos, meta, logits_rows = capture_step(llm, M, args.context)
        for d in sorted({min(int(v), M) for v in args.slots.split(",")}):
            row_slots = (torch.arange(M) % d).to(torch.int32)
            runs = {
                "base": lambda: fd(ids, pos, meta, logits_rows),
                "lora": lambda: fd(ids, pos, meta, logits_rows, row_slots=row_slots),
            }
            times: dict[str, list[float]] = {n: [] for n in runs}
            with torch.inference_mode():  # (each run rewrites the K/V of its rows before reading them)
                for _ in range(args.repeats):
                    for n, f in runs.items():
                        t0 = time.perf_counter()
                        f()
                        times[n].append(time.perf_counter() - t0)
            base, lora = statistics.median(times["base"]), statistics.median(times["lora"])
            ratio = statistics.median(b / a for a, b in zip(times["base"], times["lora"]))
            print(
                f"step rows {M:3d} adapters {d:3d}: no adapters {base * 1e3:6.2f}  with {lora * 1e3:6.2f}  "
                f"ratio {ratio:.3f}"
            )


if __name__ == "__main__":
    main()
