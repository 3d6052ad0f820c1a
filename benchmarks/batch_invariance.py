#!/usr/bin/env python
"""What batch invariance costs: the same engine with it on and off, interleaved, same process.

    python benchmarks/batch_invariance.py                     # SmolLM2 bf16, 32 x 256 in x 128 out, 5 rounds
    python benchmarks/batch_invariance.py -n 1 --output-len 64   # batch 1 (time per output token)
    python benchmarks/batch_invariance.py --check 64          # also: greedy ids alone vs all at once
    python benchmarks/batch_invariance.py --wait-idle 600     # on a shared machine

Two engines on the same model folder are loaded in this process, one batch-invariant (the
default: cpu_kernels.batch_invariant()) and one not (TOKENMILL_BATCH_INVARIANT=0: oneDNN for
prompt steps, the prefill attention kernel, decode attention split over the threads at small
batches). Each round runs the workload of benchmarks/throughput.py (N seeded random-token
prompts of --input-len tokens, fresh each round so that no run hits a prefix cache, all
submitted at once, each generating exactly --output-len tokens, greedy) on both, in alternating
order, so that load from other processes hits both alike.
Prints per round and as medians: output tokens/s of each, on / off, and the CPU other processes
used meanwhile (figures from rounds where they used more than 0.25 cores are not comparable).

--check N: N random prompts (5-120 tokens), 24 greedy tokens each, generated one at a time and
all at once by each engine: how many of the N outputs differ (bf16: 0 when invariant).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import CpuMeter, make_prompts, special_token_ids, wait_idle  # noqa: E402


def load(model_dir: str, invariant: bool, args):
    from tokenmill import LLM
    from tokenmill.kernels import cpu_kernels

    cpu_kernels.set_batch_invariant(invariant)
    try:
        return LLM(
            model_dir,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    finally:
        cpu_kernels.set_batch_invariant(None)


def check(llms: dict, n: int) -> None:
    from tokenmill import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(100, 20000, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for name, llm in llms.items():
        alone = [
            llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts
        ]
        together = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        ]
        print(
            f"  {name:14s} greedy outputs that differ alone vs all at once: "
            f"{sum(a != b for a, b in zip(alone, together))} of {n}"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the built-in SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", "-n", type=int, default=32, help="prompts, all submitted at once (concurrency)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=float, default=1.0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each timed run, wait up to this long for other processes to go quiet",
    )
    p.add_argument(
        "--check", type=int, default=0, metavar="N", help="also count greedy outputs that change with the batch"
    )
    args = p.parse_args(argv)

    from tokenmill import SamplingParams
    from tokenmill.model.loader import resolve_model_path

    model_dir = resolve_model_path(args.model)
    llms = {"invariant": load(model_dir, True, args), "not invariant": load(model_dir, False, args)}
    for name, llm in llms.items():
        runner = llm.engine.core.runner
        attn = getattr(runner.attn, "batch_invariant", None)
        print(f"{name}: attention rows kernel {attn}, fused step {type(runner.fast_decode).__name__}")
    tok = llms["invariant"].engine.tokenizer
    vocab = llms["invariant"].engine.config.model.vocab_size
    excluded = special_token_ids(tok)
    prompts = make_prompts(args.num_prompts, args.input_len, vocab, excluded, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate(
            prompt_token_ids=prompts[:2],
            sampling_params=SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
    threads = torch.get_num_threads()
    rates: dict[str, list[float]] = {name: [] for name in llms}
    print(f"{args.num_prompts} prompts x {args.input_len} in x {args.output_len} out, {args.dtype}, {threads} threads")
    for r in range(args.rounds):
        # fresh prompts each round (the same for both engines), so that no run hits a prefix cache
        prompts = make_prompts(args.num_prompts, args.input_len, vocab, excluded, seed=1000 + r)
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        line = []
        for name in order:
            wait_idle(args.wait_idle, 0.2, f"round {r + 1} {name}")
            with CpuMeter(threads) as m:
                llms[name].generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            rate = args.num_prompts * args.output_len / m.wall
            rates[name].append(rate)
            others = m.facts()["others_cpu_cores"]
            line.append(
                f"{name} {rate:7.1f} tok/s ({m.wall:5.2f} s, others {others if others is not None else '?'} cores)"
            )
        print(f"  round {r + 1}: " + "; ".join(line))
    med = {name: statistics.median(v) for name, v in rates.items()}
    print(
        f"median output tok/s: invariant {med['invariant']:.1f}, not invariant {med['not invariant']:.1f}: "
        f"on / off = {med['invariant'] / med['not invariant']:.3f}"
    )
    if args.check:
        check(llms, args.check)


if __name__ == "__main__":
    main()
