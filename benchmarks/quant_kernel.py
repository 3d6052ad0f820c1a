#!/usr/bin/env python
"""The int4 / int8 linear kernel alone, against the bf16 panel kernel and the memory-bandwidth
bound of its weight bytes, at SmolLM2's shapes: the kernel the engine runs (on AVX2 builds the
output-panel one, csrc/quant_panels.cpp, else csrc/quant_linear.cpp's row tiles), and where the
panels exist, the row-tile kernel beside it ("rows"); where the int8 products run on AMX-INT8 tiles
(from 16 rows), the same products on the vector path beside them ("vector ints", the same bits).

    python benchmarks/quant_kernel.py                        # rows 1 8 32, all shapes
    python benchmarks/quant_kernel.py --rows 1 --threads 1 --repeats 5

For each of SmolLM2-135M's linears as the engine runs them (q/k/v and gate/up fused; 30 copies of
each, so that the weights come from memory as in a decode step; the LM head: one copy, int8 as
`--quantization int4` keeps it) and each batch size, the int4 (LM head: int8) kernel and the bf16
panel kernel run interleaved, bf16 activations; prints the median time per layer of each, their
ratio, and the weight bytes each streamed per second against `--bandwidth` (default: measured
here, as `tokenmill bench roofline` does): at 1 row the quantized kernel's bound is its bytes at
that bandwidth.
"""

from __future__ import annotations

import argparse

import torch
from panel_linear import time_interleaved  # benchmarks/ is on the path when run as a script

# name -> (out_features N, in_features K, bits of the quantized variant)
SHAPES = {
    "qkv": (960, 576, 4),
    "o": (576, 576, 4),
    "gate_up": (3072, 576, 4),
    "down": (576, 1536, 4),
    "lm_head": (49152, 576, 8),
}


def quant_bytes(N: int, K: int, bits: int) -> int:
    """Weight bytes of an [N, K] quantized linear: codes plus float16 scales (and offsets)."""
    return N * K * bits // 8 + N * (K // 32) * (4 if bits == 4 else 2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32", help="batch sizes (comma-separated)")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="which linears (comma-separated)")
    p.add_argument("--bandwidth", type=float, default=0.0, help="GB/s (0: measure)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.bench.offline import measure_bandwidth
    from tokenmill.kernels import cpu_kernels
    from tokenmill.model.layers.quantization import quantize, to_panels

    k = cpu_kernels.load()
    if k is None or not hasattr(k, "panel_linear"):
        raise SystemExit("the C++ kernels (with the panel kernel) are unavailable")
    bw = args.bandwidth * 1e9 or measure_bandwidth(0.5, 3)
    print(
        f"{torch.get_num_threads()} threads, bandwidth {bw / 1e9:.1f} GB/s; median us per layer of "
        f"{args.repeats} interleaved runs; GB/s = weight bytes / time"
    )
    for name in args.shapes.split(","):
        N, K, bits = SHAPES[name]
        copies = 1 if name == "lm_head" else 30
        torch.manual_seed(0)
        ws = [torch.randn(N, K).bfloat16() * 0.05 for _ in range(copies)]
        panels = [k.pack_panels(w) for w in ws]
        quant = [quantize(w, bits) for w in ws]
        del ws
        qpanels = [to_panels(q, s, bits) for q, s in quant] if hasattr(k, "quant_panel_linear") else None
        qb = quant_bytes(N, K, bits)
        amx = qpanels is not None and hasattr(k, "quant_panels_amx") and k.quant_panels_amx(1 << 62)
        amx_int = qpanels is not None and hasattr(k, "quant_panels_amx_int") and k.quant_panels_amx_int(1 << 62)
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K).bfloat16()
            runs = {
                "quant": lambda: [k.quant_linear(x, q, s, bits) for q, s in quant],
                "bf16": lambda: [k.panel_linear(x, w, N) for w in panels],
            }
            if qpanels is not None:  # the engine's kernel here; the row tiles beside it
                runs["rows"] = runs["quant"]
                runs["quant"] = lambda: [k.quant_panel_linear(x, q, s, bits, N) for q, s in qpanels]
            if amx:  # int8 activations (the engine's below its AMX rows) and the AMX tiles, forced
                runs["quant"] = lambda: with_amx_rows(
                    k, 1 << 62, lambda: [k.quant_panel_linear(x, q, s, bits, N) for q, s in qpanels]
                )
                runs["amx"] = lambda: with_amx_rows(
                    k, 1, lambda: [k.quant_panel_linear(x, q, s, bits, N) for q, s in qpanels]
                )
            if amx_int:  # the int8 products without the AMX-INT8 tiles: the vector path (the same bits)
                runs["vector"] = lambda: with_amx_rows(
                    k, 1 << 62, lambda: [k.quant_panel_linear(x, q, s, bits, N) for q, s in qpanels], int_rows=1 << 62
                )
            t = time_interleaved(runs, args.repeats, copies)
            tq, tb = t["quant"], t["bf16"]
            rows = f"  rows {t['rows'] * 1e6:8.1f} us ({t['rows'] / tq:4.2f}x)" if "rows" in t else ""
            if "vector" in t:
                rows += f"  vector ints {t['vector'] * 1e6:8.1f} us (tiles {t['vector'] / tq:4.2f}x faster)"
            if "amx" in t:
                rows += f"  amx {t['amx'] * 1e6:8.1f} us ({tq / t['amx']:4.2f}x faster, {tb / t['amx']:4.2f}x bf16)"
            print(
                f"{name:8s} int{bits} rows {M:3d}: {tq * 1e6:8.1f} us ({qb / tq / 1e9:5.1f} GB/s, "
                f"{qb / bw / tq:4.0%} of the bound)  bf16 panels {tb * 1e6:8.1f} us ({N * K * 2 / tb / 1e9:5.1f} GB/s)"
                f"  bf16 / int{bits} {tb / tq:5.2f}x  {2 * M * N * K / tq / 1e9:5.1f} GFLOP/s{rows}"
            )


def with_amx_rows(k, rows: int, fn, int_rows: int | None = None):
    """fn() with the kernels' AMX threshold at `rows` (and the AMX-INT8 one at `int_rows`), then back
    at the defaults."""
    from tokenmill.model.layers.quantization import LARGE_BATCH

    k.set_quant_amx_rows(rows)
    if int_rows is not None:
        k.set_quant_amx_int_rows(int_rows)
    try:
        return fn()
    finally:
        k.set_quant_amx_rows(LARGE_BATCH)
        if int_rows is not None:
            k.set_quant_amx_int_rows(k.QUANT_AMX_INT_ROWS)


if __name__ == "__main__":
    main()
