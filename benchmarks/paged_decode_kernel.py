"""Micro-benchmark of the C++ paged decode attention kernels (`paged_decode`, `paged_rows`).

    python benchmarks/paged_decode_kernel.py                      # the package's kernel
    python benchmarks/paged_decode_kernel.py --source OLD.cpp     # another version of the source
    python benchmarks/paged_decode_kernel.py --source OLD.cpp --compare   # both, interleaved
    python benchmarks/paged_decode_kernel.py --rows 1,5,9,13 --batch 1 --context 256 1000 2000
        # the rows kernel: each sequence's last R rows at once (a speculative verification chunk)

SmolLM2-135M's attention shape by default (H=9, Hkv=3, D=64, block size 16), bf16 queries,
bf16 or int8 (+ float32 scales) caches, ~--context keys per sequence (jittered), blocks drawn
at random from a pool (--rows: `paged_rows` on R query rows per sequence, its last R
positions, as the batch-invariant engine runs a verification chunk). Every call reads a different part of a pool of at least --pool-mb MB,
so that K/V come from memory as in a real decode step (a layer's cache is read once a step),
not from the last-level cache (--hot reuses one set of tables), on transparent huge pages as the
engine's cache is (--small-pages: 4 KiB pages). Prints the median time per
call in µs and the effective bandwidth: bytes of K and V (and int8 scales) read / time; with
two or more versions, speedup = first version's time / last version's, and the largest
output difference between them.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BINDINGS = """#include <torch/extension.h>
namespace tm_cpu {  // torch_lite.h's allocation helpers (kernels/csrc/bindings.cpp defines them in the package)
at::Tensor empty(at::IntArrayRef sizes, at::TensorOptions options) { return at::empty(sizes, options); }
at::Tensor empty_like(const at::Tensor& x) { return at::empty_like(x); }
at::Tensor zeros(at::IntArrayRef sizes, at::TensorOptions options) { return at::zeros(sizes, options); }
}
torch::Tensor paged_decode(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double,
                           c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, double);
torch::Tensor paged_rows(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                         int64_t, double, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, double);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_rows", &paged_rows, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("block_size"), py::arg("scale"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
}
"""


def load_source(path: str, tag: str):
    """A stand-alone paged_attention.cpp (with paged_rows.cpp beside it, where the rows kernel has a
    file of its own; the package's headers otherwise) with bindings of its two ops, compiled for the
    ISA level this machine loads (TOKENMILL_CPU_ISA caps it)."""
    from torch.utils.cpp_extension import load

    from tokenmill.kernels import build as kernel_build
    from tokenmill.kernels import isa

    build = Path(tempfile.gettempdir()) / f"tokenmill_bench_{tag}"
    build.mkdir(parents=True, exist_ok=True)
    bindings = build / "bench_bindings.cpp"
    bindings.write_text(BINDINGS)
    sources = [path] + [str(p) for p in [Path(path).with_name("paged_rows.cpp")] if p.exists()]
    flags = [f for f in kernel_build.COMMON_FLAGS if f not in ("-std=c++20", "-fvisibility=hidden")]
    return load(
        name=f"tokenmill_bench_{tag}",
        sources=[*sources, str(bindings)],
        extra_cflags=flags + list(isa.selected_level().compile_flags),
        extra_include_paths=[str(Path(path).parent), str(kernel_build.CSRC)],
        build_directory=str(build),
        verbose=False,
    )


def make_case(B: int, args, cache: str, gen: torch.Generator, context: int, rows: int = 1):
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    lens = [
        max(rows, context + int(torch.randint(-args.jitter, args.jitter + 1, (1,), generator=gen))) for _ in range(B)
    ]
    max_blocks = math.ceil(max(lens) / bs)
    blocks_per_call = sum(math.ceil(n / bs) for n in lens)
    elem = 1 if cache == "int8" else 2
    bytes_per_block = bs * Hkv * D * elem * 2 + (bs * Hkv * 4 * 2 if cache == "int8" else 0)
    n_sets = 1 if args.hot else max(4, math.ceil(args.pool_mb * 2**20 / (blocks_per_call * bytes_per_block)))
    n_sets = min(n_sets, 4096)
    num_blocks = n_sets * blocks_per_call + 1
    slots = num_blocks * bs
    if cache == "int8":
        kc = torch.randint(-127, 128, (slots, Hkv, D), dtype=torch.int8, generator=gen)
        vc = torch.randint(-127, 128, (slots, Hkv, D), dtype=torch.int8, generator=gen)
        ks = torch.rand(slots, Hkv, generator=gen) * 0.02 + 0.001
        vs = torch.rand(slots, Hkv, generator=gen) * 0.02 + 0.001
        extra = (ks, vs)
    else:
        kc = torch.randn(slots, Hkv, D, generator=gen).to(torch.bfloat16)
        vc = torch.randn(slots, Hkv, D, generator=gen).to(torch.bfloat16)
        extra = ()
    if not args.small_pages:  # as the engine allocates its cache (runner.allocate_kv_cache)
        from tokenmill.kernels.memory import huge_page_empty

        def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
            return huge_page_empty(tuple(t.shape), t.dtype).copy_(t)

        kc, vc, extra = on_huge_pages(kc), on_huge_pages(vc), tuple(on_huge_pages(t) for t in extra)
    if args.layout == "random":
        perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    else:  # each call's blocks in one run of the pool, in order
        perm = torch.arange(1, num_blocks)
    tables = []
    for s in range(n_sets):
        mine = perm[s * blocks_per_call : (s + 1) * blocks_per_call].tolist()
        t = torch.zeros(B, max_blocks, dtype=torch.int64)
        k = 0
        for b, n in enumerate(lens):
            nb = math.ceil(n / bs)
            t[b, :nb] = torch.tensor(mine[k : k + nb])
            k += nb
        tables.append(t)
    q = torch.randn(B * rows, H, D, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    kv_bytes = sum(lens) * Hkv * (D * elem + (4 if cache == "int8" else 0)) * 2
    # rows > 0: paged_rows with query_start_loc (each sequence's last `rows` positions)
    loc = torch.arange(B + 1, dtype=torch.int64) * rows if args.rows else None
    return q, kc, vc, tables, seq_lens, extra, kv_bytes, loc


def call(mod, case, table, args):
    q, kc, vc, _, seq_lens, extra, _, loc = case
    scale = args.head_dim**-0.5
    if loc is not None:
        return mod.paged_rows(q, kc, vc, table, seq_lens, loc, args.block_size, scale, *extra)
    return mod.paged_decode(q, kc, vc, table, seq_lens, args.block_size, scale, *extra)


def time_kernel(mod, case, args) -> float:
    tables = case[3]
    n = len(tables)
    for i in range(min(n, 8)):
        call(mod, case, tables[i % n], args)
    times = []
    for i in range(args.iters):
        t = tables[i % n]
        t0 = time.perf_counter()
        call(mod, case, t, args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(mods, case, args):
    outs = [call(m, case, case[3][0], args).float() for m in mods]
    return max(float((o - outs[0]).abs().max()) for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--source",
        nargs="+",
        default=[],
        help="build these stand-alone paged_attention.cpp versions instead of the package's",
    )
    p.add_argument("--compare", action="store_true", help="time --source and the package's kernel, interleaved")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--cache", nargs="+", default=["bf16", "int8"], choices=["bf16", "int8"])
    p.add_argument("--context", type=int, nargs="+", default=[384])
    p.add_argument(
        "--rows",
        default=None,
        help="comma-separated query rows per sequence: time paged_rows (the rows kernel) instead",
    )
    p.add_argument("--jitter", type=int, default=16)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3, help="repeat the whole sweep; report the median of rounds")
    p.add_argument("--pool-mb", type=float, default=256)
    p.add_argument(
        "--layout",
        choices=["random", "contiguous"],
        default="random",
        help="blocks of a call drawn at random from the pool (default) or consecutive",
    )
    p.add_argument("--hot", action="store_true", help="one set of tables: K/V mostly from cache")
    p.add_argument(
        "--small-pages",
        action="store_true",
        help="the cache on 4 KiB pages (default: transparent huge pages, as the engine's)",
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    mods = {}
    for src in args.source:
        mods[Path(src).stem] = load_source(src, "src_" + hashlib.sha256(Path(src).read_bytes()).hexdigest()[:12])
    if not args.source or args.compare:
        from tokenmill.kernels import cpu_kernels

        mods["package"] = cpu_kernels.load()
        if mods["package"] is None:
            sys.exit("package kernels failed to build")

    gen = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else [1]
    if args.rows and "int8" in args.cache:
        args.cache = [c for c in args.cache if c != "int8"] or ["bf16"]  # paged_rows serves bf16 caches
    print(
        f"threads={args.threads} H={args.heads} Hkv={args.kv_heads} D={args.head_dim} bs={args.block_size} "
        f"{'paged_rows' if args.rows else 'paged_decode'} {args.layout} blocks, "
        f"{'hot' if args.hot else 'cold (rotating pool)'}; medians of {args.rounds} interleaved rounds"
    )
    header = f"{'cache':>5} {'ctx':>5} {'B':>4} {'R':>3} {'MB/call':>8} "
    header += " ".join(f"{name[-9:] + ' µs':>12} {'GB/s':>6}" for name in mods)
    if len(mods) >= 2:
        header += f" {'speedup':>8} {'max|diff|':>10}"
    print(header)
    for cache in args.cache:
        for context in args.context:
            for B in args.batch:
                for R in rows_list:
                    case = make_case(B, args, cache, gen, context, R)
                    rounds = {name: [] for name in mods}
                    for _ in range(args.rounds):
                        for name, mod in mods.items():
                            rounds[name].append(time_kernel(mod, case, args))
                    med = {name: statistics.median(v) for name, v in rounds.items()}
                    kv_bytes = case[6]
                    line = f"{cache:>5} {context:>5} {B:>4} {R:>3} {kv_bytes / 1e6:>8.2f} "
                    line += " ".join(f"{med[n] * 1e6:>12.1f} {kv_bytes / med[n] / 1e9:>6.1f}" for n in mods)
                    if len(mods) >= 2:
                        # speedup: the median over rounds of first / last version's time
                        names = list(mods)
                        ratio = statistics.median(x / y for x, y in zip(rounds[names[0]], rounds[names[-1]]))
                        line += f" {ratio:>7.2f}x {check(list(mods.values()), case, args):>10.2e}"
                    print(line, flush=True)
                    del case


if __name__ == "__main__":
    main()
