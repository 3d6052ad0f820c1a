"""Multi-LoRA throughput: output tok/s of the base model and of requests spread over 1, 4 and 16
LoRA adapters, at concurrency 1 and 32 (issue 18's benchmark).

Adapters: rank 16 on every linear layer (q, k, v, o, gate, up, down), made with peft on the model
(random A and B, seeded) and cached under --adapters-dir. Prompts: seeded random token ids
(--input-len, default 256), each generating exactly --output-len tokens (default 128, EOS
ignored, greedy). Each (concurrency, case) runs --requests requests (default 4 at c=1, 2 x c
above) through the offline engine with max_num_seqs = concurrency; "base" on an engine without
--enable-lora, the adapter cases on one with --enable-lora --max-loras 16 --max-lora-rank 16;
cases interleaved per repeat, tok/s the median over repeats, the ratio to base the median of
the per-repeat ratios.

    python benchmarks/lora.py                        # SmolLM2 bf16, c = 1 and 32, 3 repeats
    python benchmarks/lora.py --concurrency 1 --repeats 1
    python benchmarks/lora.py --vllm-python ~/.cache/tokenmill-peers/vllm/venv/bin/python   # + vLLM's CPU build

With --vllm-python the same cases run through vLLM's offline LLM (enable_lora, same adapters,
same prompts as token ids, same max_num_seqs) in that interpreter, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"base": 0, "1 adapter": 1, "4 adapters": 4, "16 adapters": 16}


def make_adapters(model_dir: str, out: Path, n: int, rank: int) -> list[str]:
    """n rank-`rank` adapters on every linear layer of the model (made once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [out / f"r{rank}-{i}" for i in range(n)]
    todo = [p for p in paths if not (p / "adapter_model.safetensors").exists()]
    if todo:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        model = get_peft_model(base, cfg)
        for p in todo:
            torch.manual_seed(int(p.name.rsplit("-", 1)[1]))
            with torch.no_grad():
                for name, w in model.named_parameters():
                    if "lora_" in name:
                        w.normal_(0.0, 0.01)
            model.save_pretrained(str(p))
    return [str(p) for p in paths]


def prompts(vocab: int, specials: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    ids = [t for t in range(vocab) if t not in specials]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def run_tokenmill(llm, batch: list[list[int]], loras: list, output_len: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=batch, sampling_params=sp, lora_request=loras, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


VLLM_SCRIPT = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    cfg = json.load(open(sys.argv[1]))
    res = {}
    for c in cfg["concurrency"]:
        llm = LLM(cfg["model"], dtype="bfloat16", max_num_seqs=c, enable_lora=True, max_loras=16, max_lora_rank=16,
                  max_cpu_loras=16, max_model_len=cfg["max_model_len"], seed=0)
        sp = SamplingParams(max_tokens=cfg["output_len"], temperature=0.0, ignore_eos=True)
        for runs in cfg["runs"][str(c)]:
            for case, (batch, k) in runs.items():
                loras = [LoRARequest(f"a{i % k}", i % k + 1, cfg["adapters"][i % k]) if k else None
                         for i in range(len(batch))]
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": b} for b in batch], sp, lora_request=loras, use_tqdm=False)
                dt = time.perf_counter() - t0
                tps = sum(len(o.outputs[0].token_ids) for o in outs) / dt
                res.setdefault(str(c), {}).setdefault(case, []).append(tps)
        del llm
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 4 at c=1, else 2 x concurrency)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapters-dir", default=os.path.expanduser("~/.cache/tokenmill-bench/lora"))
    ap.add_argument("--vllm-python", default=None, help="vLLM's CPU build's interpreter: run the same cases there")
    ap.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/lora-<time>.json)")
    args = ap.parse_args()
    from tokenmill import LLM, LoRARequest
    from tokenmill.model.loader import resolve_model_path

    model = resolve_model_path(args.model)  # the built-in SmolLM2 as an HF folder (bf16, converted once)
    cases = [c for c in args.cases.split(",") if c]
    adapters = make_adapters(model, Path(args.adapters_dir) / Path(model).name, max(CASES[c] for c in cases), args.rank)
    conc = [int(c) for c in args.concurrency.split(",")]
    max_model_len = args.input_len + args.output_len + 16
    results: dict[str, dict[str, list[float]]] = {}
    vllm_runs: dict[str, list[dict]] = {}
    for c in conc:
        n = args.requests or (4 if c == 1 else 2 * c)
        kw = dict(dtype=args.dtype, max_num_seqs=c, max_model_len=max_model_len)
        base = LLM(model, **kw)
        lora = LLM(model, enable_lora=True, max_loras=16, max_lora_rank=args.rank, max_cpu_loras=16, **kw)
        tok = base.get_tokenizer()
        specials = set(tok.all_special_ids)
        reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
        for rep in range(args.repeats):
            runs = {}
            for j, case in enumerate(cases):
                k = CASES[case]
                batch = prompts(
                    base.engine.config.model.vocab_size, specials, n, args.input_len, seed=1000 * c + 10 * rep + j
                )  # fresh prompts: no prefix-cache hits
                loras = [reqs[i % k] if k else None for i in range(n)]
                tps = run_tokenmill(lora if k else base, batch, loras, args.output_len)
                results.setdefault(str(c), {}).setdefault(case, []).append(tps)
                runs[case] = (batch, k)
                print(
                    json.dumps({"concurrency": c, "case": case, "repeat": rep, "output_tok_s": round(tps, 1)}),
                    flush=True,
                )
            vllm_runs.setdefault(str(c), []).append(runs)
        base.shutdown()
        lora.shutdown()
        del base, lora
    vllm = run_vllm(args, model, adapters, conc, vllm_runs, max_model_len) if args.vllm_python else {}
    rows = []
    for c in conc:
        tm = results[str(c)]
        for case in cases:
            row = {
                "concurrency": c,
                "case": case,
                "output_tok_s": round(statistics.median(tm[case]), 1),
                "vs_base": round(statistics.median(a / b for a, b in zip(tm[case], tm["base"])), 3)
                if "base" in tm
                else None,
            }
            if vllm:
                v = vllm[str(c)][case]
                row["vllm_output_tok_s"] = round(statistics.median(v), 1)
                row["tokenmill_vs_vllm"] = round(statistics.median(a / b for a, b in zip(tm[case], v)), 2)
            rows.append(row)
    print("\n| c | case | tokenmill tok/s | vs base |" + (" vLLM tok/s | tokenmill / vLLM |" if vllm else ""))
    print("|---|---|---|---|" + ("---|---|" if vllm else ""))
    for r in rows:
        extra = f" {r['vllm_output_tok_s']} | {r['tokenmill_vs_vllm']}x |" if vllm else ""
        print(f"| {r['concurrency']} | {r['case']} | {r['output_tok_s']} | {r['vs_base']}x |{extra}")
    out = args.out or str(Path(__file__).parent / "results" / f"lora-{time.strftime('%Y%m%d-%H%M%S')}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(args), "runs": results, "vllm_runs": vllm, "rows": rows}, f, indent=1)
    print(f"results: {out}")


def run_vllm(args, model, adapters, conc, runs, max_model_len) -> dict:
    """The same cases and prompts through vLLM's offline engine in its own interpreter (a process
    per concurrency: vLLM's engine core lives in a child process of its own)."""
    out = {}
    for c in conc:
        cfg = {
            "model": model,
            "adapters": adapters,
            "concurrency": [c],
            "output_len": args.output_len,
            "max_model_len": max_model_len,
            "runs": {str(c): runs[str(c)]},
        }
        with tempfile.TemporaryDirectory() as d:
            cfg_path, script = Path(d) / "cfg.json", Path(d) / "vllm_lora.py"
            cfg_path.write_text(json.dumps(cfg))
            script.write_text(VLLM_SCRIPT)
            proc = subprocess.run(
                [args.vllm_python, str(script), str(cfg_path)],
                capture_output=True,
                text=True,
                env={
                    **os.environ,
                    "VLLM_TARGET_DEVICE": "cpu",
                    "VLLM_CPU_KVCACHE_SPACE": "4",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                },
            )
        found = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not found:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            raise SystemExit("vLLM run failed (its output above)")
        out.update(found[0])
        print(json.dumps({"vllm": found[0]}), flush=True)
    return out


if __name__ == "__main__":
    main()
