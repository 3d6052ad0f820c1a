"""Shared by the A/B benchmarks that compare engine variants (KV cache dtype, weight quantization):
the 32 chat prompts of the quality check, greedy agreement against a reference variant, and
offline throughput with the variants alternating (median of repeats)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

TOPICS = [
    "the moon",
    "bread",
    "volcanoes",
    "chess",
    "rivers",
    "bees",
    "the internet",
    "glass",
    "tea",
    "maps",
    "winter",
    "trains",
    "music",
    "paper",
    "salt",
    "clocks",
    "bridges",
    "coral reefs",
    "bicycles",
    "ink",
    "lighthouses",
    "apples",
    "deserts",
    "owls",
    "batteries",
    "soap",
    "comets",
    "wool",
    "tides",
    "bells",
    "cheese",
    "kites",
]
ASKS = [
    "Explain how {} work, in three sentences.",
    "Write a short poem about {}.",
    "Give three surprising facts about {}.",
    "Describe {} to a child.",
]


def chat_outputs(llm: LLM, max_tokens: int) -> list:
    """Greedy completions (with the chosen tokens' logprobs) of the 32 chat prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    convs = [[{"role": "user", "content": ASKS[i % len(ASKS)].format(t)}] for i, t in enumerate(TOPICS)]
    return [o.outputs[0] for o in llm.chat(convs, params, use_tqdm=False)]


def agreement(ref: list, outs: list, max_tokens: int) -> dict:
    """How many outputs are identical, how far they agree on average, and the |logprob| difference
    of the same tokens over the common part (both variants score the same context there)."""
    same, agree_frac, diffs = 0, [], []
    for a, b in zip(ref, outs):
        n = 0
        while n < len(a.token_ids) and n < len(b.token_ids) and a.token_ids[n] == b.token_ids[n]:
            n += 1
        same += n == len(a.token_ids) == len(b.token_ids)
        agree_frac.append(n / len(a.token_ids))
        # Positions up to and including the first divergence share their context.
        for i in range(min(n + 1, len(a.token_ids), len(b.token_ids))):
            if a.token_ids[i] == b.token_ids[i]:
                diffs.append(abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob))
    return {
        "prompts": len(ref),
        "max_tokens": max_tokens,
        "identical_outputs": same,
        "mean_agreeing_fraction": statistics.mean(agree_frac),
        "logprob_abs_diff_mean": statistics.mean(diffs),
        "logprob_abs_diff_p99": sorted(diffs)[int(0.99 * len(diffs))],
        "logprob_abs_diff_max": max(diffs),
        "tokens_compared": len(diffs),
    }


def describe_agreement(q: dict) -> str:
    return (
        f"{q['identical_outputs']}/{q['prompts']} identical, {100 * q['mean_agreeing_fraction']:.1f}% of tokens "
        f"before the first divergence; |logprob diff| mean {q['logprob_abs_diff_mean']:.4f}, "
        f"p99 {q['logprob_abs_diff_p99']:.4f}, max {q['logprob_abs_diff_max']:.4f} over {q['tokens_compared']} tokens"
    )


def alternating_throughput(
    llms: dict[str, LLM], num_prompts: int, input_len: int, output_len: int, repeats: int
) -> dict[str, list[float]]:
    """Offline output tok/s of each variant on the same seeded random prompts, variants alternating."""
    tok = next(iter(llms.values())).get_tokenizer()
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    res: dict[str, list[float]] = {name: [] for name in llms}
    for rep in range(repeats):
        rng = random.Random(rep)
        prompts = [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num_prompts)]
        for name, llm in llms.items():
            llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4), use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
            res[name].append(tps)
            print(f"  repeat {rep + 1} {name:5}: {tps:7.1f} output tok/s", flush=True)
    return res


def add_workload_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The flags every variant benchmark takes: quality length, speed workload, result path."""
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per quality prompt")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", default=out)


def write_result(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
