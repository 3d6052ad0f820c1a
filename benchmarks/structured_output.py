"""The throughput cost of structured output: the same requests with and without a JSON schema.

    python benchmarks/structured_output.py        # SmolLM2 bf16, 32 chat requests, median of 3

Each request asks for a person as JSON; both runs sample (temperature 0.7, seeded) up to
--max-tokens. With the schema, requests stop when the JSON is complete, so the figure compared
is output tokens per second of engine time, and the time per step spent on grammar masks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import GuidedDecodingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 30},
        "hobbies": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 20}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def run(llm, n: int, max_tokens: int, guided: bool, seed: int) -> float:
    convs = [[{"role": "user", "content": f"Describe person number {i} as a JSON object."}] for i in range(n)]
    params = [
        SamplingParams(
            temperature=0.7,
            seed=seed + i,
            max_tokens=max_tokens,
            guided_decoding=GuidedDecodingParams(json=SCHEMA) if guided else None,
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=1.0, enable_prefix_caching=False)
    run(llm, 2, 8, True, 0)  # warm-up: tokenizer and grammar compiled
    res = {"free": [], "json_schema": []}
    for rep in range(args.repeats):
        for mode in res:
            tps = run(llm, args.num_requests, args.max_tokens, mode == "json_schema", 100 * rep)
            res[mode].append(tps)
            print(f"repeat {rep + 1} {mode:11}: {tps:7.1f} output tok/s", flush=True)
    free, guided = statistics.median(res["free"]), statistics.median(res["json_schema"])
    print(
        f"median: free {free:.1f} tok/s, JSON schema {guided:.1f} tok/s: {guided / free:.2f}x "
        f"({100 * (1 - guided / free):.1f}% cost)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
