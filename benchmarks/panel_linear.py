#!/usr/bin/env python
"""The panel kernel (csrc/panel_linear.cpp) against oneDNN's packed GEMM, per linear shape.

    python benchmarks/panel_linear.py                    # SmolLM2-135M's shapes, rows 1 8 16 32 64
    python benchmarks/panel_linear.py --rows 1,2,4,128

For each of SmolLM2's linears (qkv, o, gate_up, down: 30 copies each, so that weights come from
memory as in a decode step; the LM head: one 56 MB copy) and each batch size, the two kernels run
interleaved (`--repeats` times each); prints the median GFLOP/s of each, their ratio, and at one
row the weight bytes streamed per second. `--float32` adds F.linear on float32 copies of the
weights (twice the bytes; what a float32 model runs): the peer to beat where oneDNN has no
native bf16 (AVX2 CPUs). `--w8a8` adds the W8A8 kernel (csrc/w8a8.cpp, `--quantization w8a8`:
int8 weights, the bf16 rows quantized per token inside the call) on the same weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {"qkv": (832, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def time_interleaved(runs: dict, repeats: int, copies: int = 1) -> dict[str, float]:
    """Median seconds per call of each function (one warm-up call each, then the functions
    interleaved `repeats` times, so that a noisy moment hits them alike); each call runs `copies`
    layers."""
    times: dict[str, list[float]] = {n: [] for n in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for n, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[n].append((time.perf_counter() - t0) / copies)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64", help="batch sizes (comma-separated)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--float32", action="store_true", help="also time F.linear on float32 weights")
    p.add_argument("--w8a8", action="store_true", help="also time the W8A8 kernel on int8 copies of the weights")
    p.add_argument("--shapes", default=",".join(SHAPES), help="which of SmolLM2's linears (comma-separated)")
    args = p.parse_args(argv)
    from tokenmill.kernels import cpu_kernels

    k = cpu_kernels.load()
    if k is None or not hasattr(k, "panel_linear"):
        raise SystemExit("the C++ kernels are unavailable")
    print(f"{torch.get_num_threads()} threads; GFLOP/s, medians of {args.repeats} interleaved runs")
    for name in args.shapes.split(","):
        N, K = SHAPES[name]
        copies = 1 if name == "lm_head" else 30
        ws = [torch.randn(N, K).bfloat16() for _ in range(copies)]
        try:
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws]
        except RuntimeError:  # no oneDNN bf16 GEMM on this CPU (AVX2): float32 is the peer
            onednn, args.float32 = [], True
        panels = [k.pack_panels(w) for w in ws]
        fp32 = [w.float() for w in ws] if args.float32 else []
        if args.w8a8:
            from tokenmill.model.layers.w8a8 import W8A8Linear

            w8 = [W8A8Linear(w.float()) for w in ws]
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K).bfloat16()
            xf = x.float()
            runs = {"panels": lambda: [k.panel_linear(x, w, N) for w in panels]}
            if onednn:
                runs["oneDNN"] = lambda: [
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in onednn
                ]
            if fp32:
                runs["float32"] = lambda: [torch.nn.functional.linear(xf, w) for w in fp32]
            if args.w8a8:
                runs["w8a8"] = lambda: [lin(x) for lin in w8]
            times = time_interleaved(runs, args.repeats, copies)
            t2 = times["panels"]
            flop = 2 * M * N * K
            line = f"{name:8s} rows {M:4d}: panels {flop / t2 / 1e9:6.0f}"
            if onednn:
                t1 = times["oneDNN"]
                line += f"  oneDNN {flop / t1 / 1e9:6.0f}  panels / oneDNN {t1 / t2:5.2f}x"
            if fp32:
                t3 = times["float32"]
                line += f"  float32 {flop / t3 / 1e9:6.0f}  panels / float32 {t3 / t2:5.2f}x"
            if args.w8a8:
                t4 = times["w8a8"]
                line += f"  w8a8 {flop / t4 / 1e9:6.0f}  w8a8 / panels {t2 / t4:5.2f}x"
            if M == 1:
                line += f"  (panels stream {N * K * 2 / t2 / 1e9:.1f} GB/s)"
            print(line)


if __name__ == "__main__":
    main()
