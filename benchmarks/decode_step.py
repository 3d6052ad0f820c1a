#!/usr/bin/env python
"""The fused decode step against the same step run op by op, on a real decode batch.

    python benchmarks/decode_step.py                          # SmolLM2 bf16, 1 8 16 32 rows, 256-token prompts
    python benchmarks/decode_step.py --rows 1 --context 32 --quantization gguf

For each batch size, generates from that many prompts until a step has only decode rows, keeps
that step's inputs, then runs the model's forward + LM head on them two ways, interleaved
(`--repeats` times each): the fused C++ step (csrc/decode_step.cpp) and the module-by-module
path the runner takes otherwise. Prints median milliseconds, the ratio and (one row) the weight
bytes read per second; checks that both give the same logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def capture_step(llm, rows: int, context: int):
    """(input_ids, positions, meta, logits_rows) of the first all-decode step with `rows` rows."""
    from tokenmill import SamplingParams

    runner = llm.engine.core.runner
    found, inner = [], runner.execute

    def spy(sched):
        if not found and len(sched.scheduled) == rows and all(s.num_new_tokens == 1 for s in sched.scheduled):
            found.append(runner.prepare(sched))
        return inner(sched)

    runner.execute = spy
    try:
        prompts = [[1000 + (i * 7 + j) % 40000 for j in range(context)] for i in range(rows)]
        # Enough tokens that the first prompts still decode when the last prompt chunk is done.
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    finally:
        runner.execute = inner
    if not found:
        raise SystemExit(f"no all-decode step of {rows} rows happened")
    step = found[0]
    return step.input_ids, step.positions, step.meta, step.logits_rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--rows", default="1,8,16,32")
    p.add_argument("--context", type=int, default=256, help="prompt tokens per row")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args(argv)
    from tokenmill import LLM
    from tokenmill.bench.offline import decode_weight_bytes

    llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False, max_num_seqs=256)
    runner = llm.engine.core.runner
    fused, model = runner.fast_decode, runner.model
    if fused is None:
        raise SystemExit("the fused decode step is off here (see the log)")
    weight_bytes = decode_weight_bytes(model)
    print(
        f"{torch.get_num_threads()} threads; {args.context}-token prompts; medians of {args.repeats} interleaved runs"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        ids, pos, meta, logits_rows = capture_step(llm, rows, args.context)
        kv = runner.kv_cache.clone()

        def op_by_op():
            return model.compute_logits(model(ids, pos, runner.attn, meta)[logits_rows])

        def one_call():
            return fused(ids, pos, meta, logits_rows)

        times: dict[str, list[float]] = {"op by op": [], "fused": []}
        with torch.inference_mode():
            runner.kv_cache.copy_(kv)
            want = op_by_op()
            runner.kv_cache.copy_(kv)
            same = torch.equal(one_call(), want)
            for _ in range(args.repeats):
                for name, f in (("op by op", op_by_op), ("fused", one_call)):
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
        a, b = statistics.median(times["op by op"]), statistics.median(times["fused"])
        ratio = statistics.median(x / y for x, y in zip(times["op by op"], times["fused"]))
        line = f"rows {rows:3d}: op by op {a * 1e3:7.2f} ms  fused {b * 1e3:7.2f} ms  ratio {ratio:.2f}x  same logits: {same}"
        if rows == 1:
            line += f"  (fused reads {weight_bytes / b / 1e9:.1f} GB/s of weights)"
        print(line)


if __name__ == "__main__":
    main()
