"""--kv-cache-dtype int8 against the full-precision cache: quality and speed, one run.

    python benchmarks/kv_cache_dtype.py            # SmolLM2 bf16: 32 prompts for quality, 64x256x128 for speed

Quality: 32 chat prompts, greedy, 64 tokens, with the sampled tokens' logprobs. Reports how many
outputs are identical, how far they agree on average, and the |logprob| difference of the
same tokens over the common part (both engines score the same context there).
Speed: offline output throughput on seeded random prompts, the two caches alternating,
median of --repeats. Also prints the KV bytes per token and the tokens a budget holds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

TOPICS = ["the moon", "bread", "volcanoes", "chess", "rivers", "bees", "the internet", "glass", "tea", "maps",
          "winter", "trains", "music", "paper", "salt", "clocks", "bridges", "coral reefs", "bicycles", "ink",
          "lighthouses", "apples", "deserts", "owls", "batteries", "soap", "comets", "wool", "tides", "bells",
          "cheese", "kites"]
ASKS = ["Explain how {} work, in three sentences.", "Write a short poem about {}.",
        "Give three surprising facts about {}.", "Describe {} to a child."]


def quality(model: str | None, dtype: str, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    convs = [[{"role": "user", "content": ASKS[i % len(ASKS)].format(t)}] for i, t in enumerate(TOPICS)]
    outs = {}
    for kv in ("auto", "int8"):
        llm = LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1.0, enable_prefix_caching=False)
        outs[kv] = [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]
        del llm
    same, agree_frac, diffs = 0, [], []
    for a, b in zip(outs["auto"], outs["int8"]):
        n = 0
        while n < len(a.token_ids) and n < len(b.token_ids) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        same += n == len(a.token_ids) == len(b.token_ids)
        agree_frac.append(n / len(a.token_ids))
        # Positions up to and including the first divergence share their context.
        for i in range(min(n + 1, len(a.token_ids), len(b.token_ids))):
            if a.token_ids[i] == b.token_ids[i]:
                diffs.append(abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob))
    return {"prompts": len(convs), "max_tokens": max_tokens, "identical_outputs": same,
            "mean_agreeing_fraction": statistics.mean(agree_frac),
            "logprob_abs_diff_mean": statistics.mean(diffs), "logprob_abs_diff_p99": sorted(diffs)[int(0.99 * len(diffs))],
            "logprob_abs_diff_max": max(diffs), "tokens_compared": len(diffs)}


def speed(model: str | None, dtype: str, num_prompts: int, input_len: int, output_len: int, repeats: int) -> dict:
    llms = {kv: LLM(model, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=2.0, enable_prefix_caching=False)
            for kv in ("auto", "int8")}
    tok = llms["auto"].get_tokenizer()
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    res: dict[str, list[float]] = {"auto": [], "int8": []}
    for rep in range(repeats):
        rng = random.Random(rep)
        prompts = [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num_prompts)]
        for kv, llm in llms.items():
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            res[kv].append(tps)
            print(f"  repeat {rep + 1} {kv:4}: {tps:7.1f} output tok/s", flush=True)
    kvb = {kv: llm.engine.config.model.kv_bytes_per_token() for kv, llm in llms.items()}
    med = {kv: statistics.median(v) for kv, v in res.items()}
    return {"runs": res, "median_tok_s": med, "int8_over_auto": med["int8"] / med["auto"],
            "kv_bytes_per_token": kvb, "int8_memory_ratio": kvb["int8"] / kvb["auto"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/kv_cache_dtype.json")
    args = ap.parse_args(argv)
    result = {"args": vars(args), "quality": quality(args.model, args.dtype, args.max_tokens)}
    q = result["quality"]
    print(f"quality ({args.dtype} model, int8 vs {args.dtype} cache, {q['prompts']} prompts x {q['max_tokens']} "
          f"greedy tokens): {q['identical_outputs']}/{q['prompts']} identical, {100 * q['mean_agreeing_fraction']:.1f}% "
          f"of tokens before the first divergence; |logprob diff| mean {q['logprob_abs_diff_mean']:.4f}, "
          f"p99 {q['logprob_abs_diff_p99']:.4f}, max {q['logprob_abs_diff_max']:.4f} over {q['tokens_compared']} tokens",
          flush=True)
    if not args.skip_speed:
        s = result["speed"] = speed(args.model, args.dtype, args.num_prompts, args.input_len, args.output_len,
                                    args.repeats)
        print(f"speed ({args.num_prompts} x {args.input_len} in x {args.output_len} out, median of {args.repeats}): "
              f"{args.dtype} cache {s['median_tok_s']['auto']:.1f} tok/s, int8 cache {s['median_tok_s']['int8']:.1f} "
              f"tok/s ({s['int8_over_auto']:.2f}x); KV bytes/token {s['kv_bytes_per_token']['auto']} -> "
              f"{s['kv_bytes_per_token']['int8']} ({s['int8_memory_ratio']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
