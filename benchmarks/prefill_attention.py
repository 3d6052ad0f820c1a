"""Micro-benchmark of prompt-chunk (prefill) attention, one layer call, CPU.

    python benchmarks/prefill_attention.py                 # SmolLM2-135M shape, bf16, 2 threads
    python benchmarks/prefill_attention.py --cache int8    # int8 cache (+ float32 scales)

Per case (chunk of n queries after `context` cached tokens) it times what
AttentionBackend.forward did per chunk before the C++ prefill kernel:
  sdpa-fresh   context 0: SDPA, is_causal, over the chunk's fresh K/V ([n, Hkv, D] views)
  sdpa-gather  context > 0 (and, for reference, 0): gather prefix + chunk K/V from the paged cache
               (dequantized when int8), boolean causal mask, SDPA
and the kernel, `paged_prefill`, which reads every key in place through the block table.
Blocks are drawn at random from a pool. Prints median ms per call and GFLOP/s of the kernel
(causal work: 4 * H * D * sum of visible keys per query).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fns, reps: int) -> list[float]:
    """Median ms per call of each fn, timed round-robin so that load on the machine hits all alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for fn, t_list in zip(fns, ts):
            t = time.perf_counter()
            fn()
            t_list.append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--cache", choices=["same", "int8"], default="same")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="256:0,512:0,1024:0,256:768", help="n:context,...")
    args = ap.parse_args()

    from tokenmill.kernels import cpu_kernels
    from tokenmill.model.layers.attention import quantize_kv

    mod = cpu_kernels.load()
    assert mod is not None, "C++ kernels failed to build"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    H, Hkv, D, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    dt = getattr(torch, args.dtype)
    scale = D**-0.5
    print(
        f"H={H} Hkv={Hkv} D={D} block={bs} q={args.dtype} cache={args.cache} threads={args.threads}, median ms per call"
    )
    print(
        f"{'n':>5} {'ctx':>5} | {'sdpa-fresh':>10} {'sdpa-gather':>11} {'kernel':>8} | {'speedup':>7} {'GFLOP/s':>8} {'max|diff|':>9}"
    )
    for case in args.cases.split(","):
        n, ctx = (int(x) for x in case.split(":"))
        L = ctx + n
        nb = -(-L // bs)
        pool = nb * 4
        table = torch.randperm(pool)[:nb].long()
        k_all = torch.randn(pool * bs, Hkv, D)
        v_all = torch.randn(pool * bs, Hkv, D)
        q = torch.randn(n, H, D).to(dt)
        pos = torch.arange(L)
        slots = table[pos // bs] * bs + pos % bs
        scales = None
        if args.cache == "int8":
            kc, ks = quantize_kv(k_all)
            vc, vs = quantize_kv(v_all)
            scales = (ks, vs)
        else:
            kc, vc = k_all.to(dt), v_all.to(dt)
        # The chunk's fresh K/V as the backend has them: rows of the flat batch.
        k_new = (kc[slots[ctx:]].float() * scales[0][slots[ctx:]].unsqueeze(-1)).to(dt) if scales else kc[slots[ctx:]]
        v_new = (vc[slots[ctx:]].float() * scales[1][slots[ctx:]].unsqueeze(-1)).to(dt) if scales else vc[slots[ctx:]]
        qc = q.transpose(0, 1).unsqueeze(0)

        def read(cache, kv):
            x = cache[slots]
            return x if scales is None else (x.float() * scales[kv][slots].unsqueeze(-1)).to(dt)

        def sdpa_fresh():
            kk = k_new.transpose(0, 1).unsqueeze(0)
            vv = v_new.transpose(0, 1).unsqueeze(0)
            return F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, scale=scale, enable_gqa=Hkv != H)

        def sdpa_gather():
            kk = read(kc, 0).transpose(0, 1).unsqueeze(0)
            vv = read(vc, 1).transpose(0, 1).unsqueeze(0)
            mask = torch.ones(n, L, dtype=torch.bool).tril_(diagonal=ctx)
            return F.scaled_dot_product_attention(qc, kk, vv, attn_mask=mask, scale=scale, enable_gqa=Hkv != H)

        def kernel():
            return mod.paged_prefill(q, kc, vc, table, ctx, bs, scale, *(scales or ()))

        if ctx == 0:
            t_fresh, t_gather, t_kernel = median_ms([sdpa_fresh, sdpa_gather, kernel], args.reps)
        else:
            t_fresh = float("nan")
            t_gather, t_kernel = median_ms([sdpa_gather, kernel], args.reps)
        base = t_fresh if ctx == 0 else t_gather
        diff = (kernel().float() - sdpa_gather().squeeze(0).transpose(0, 1).float()).abs().max().item()
        flops = 4 * H * D * sum(ctx + i + 1 for i in range(n))
        print(
            f"{n:>5} {ctx:>5} | {t_fresh:>10.3f} {t_gather:>11.3f} {t_kernel:>8.3f} | {base / t_kernel:>6.2f}x "
            f"{flops / t_kernel / 1e6:>8.1f} {diff:>9.2e}"
        )


if __name__ == "__main__":
    main()
