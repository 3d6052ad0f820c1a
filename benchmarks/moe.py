"""Mixture of experts: output tok/s of a randomly initialised Mixtral-shaped model at concurrency 1
and 32, tokenmill against transformers' generate on the same weights.

Model: transformers' MixtralConfig, --experts 8, --top-k 2, --hidden 512, --intermediate 1024 per
expert, --layers 4, 8 query / 2 kv heads, SmolLM2's tokenizer (vocab 49152), transformers' seeded
random init, saved once as a Hugging Face folder under --cache-dir (in --dtype). Prompts: seeded
random token ids (--input-len), each generating exactly --output-len tokens (greedy, EOS ignored).
At concurrency c, --requests requests (default 2 at c=1, else c): tokenmill's LLM.generate with
max_num_seqs=c; transformers' generate one prompt at a time at c=1, else in batches of c (left
padding, min_new_tokens = max_new_tokens), with its default experts implementation. Systems
alternate within each repeat (fresh prompts each time); tok/s is the median over --repeats, the
ratio the median of the per-repeat ratios. The 1-minute load average is printed with each run:
on a shared machine compare only figures taken at similar load.

    python benchmarks/moe.py                          # bf16, c = 1 and 32, 3 repeats
    python benchmarks/moe.py --dtype float32 --concurrency 32 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import hf_generate_batch, make_prompts, special_token_ids  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_model(args) -> str:
    """The random Mixtral-shaped folder (made once per shape and dtype)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tokenmill.model.loader import resolve_model_path

    name = f"mixtral-e{args.experts}k{args.top_k}-h{args.hidden}-i{args.intermediate}-l{args.layers}-{args.dtype}"
    out = Path(args.cache_dir) / name
    if (out / "config.json").exists():
        return str(out)
    smollm2 = Path(resolve_model_path(None))
    tok_cfg = json.loads((smollm2 / "config.json").read_text())
    cfg = MixtralConfig(
        vocab_size=tok_cfg["vocab_size"],
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        bos_token_id=tok_cfg.get("bos_token_id"),
        eos_token_id=tok_cfg.get("eos_token_id"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    MixtralForCausalLM(cfg).to(DTYPES[args.dtype]).save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / f, tmp / f)
    os.replace(tmp, out)
    return str(out)


def run_tokenmill(llm, batch: list[list[int]], output_len: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=batch, sampling_params=sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def run_hf(model, batch: list[list[int]], output_len: int, c: int, pad_id: int) -> float:
    t0 = time.perf_counter()
    n = sum(
        len(row)
        for i in range(0, len(batch), c)
        for row in hf_generate_batch(model, batch[i : i + c], output_len, pad_id)
    )
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 2 at c=1, else c)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tokenmill-bench/moe"))
    ap.add_argument("--out", default=None, help="JSON results (default: benchmarks/results/moe-<time>.json)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill import LLM

    path = build_model(args)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[args.dtype]).eval()
    tok = AutoTokenizer.from_pretrained(path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    specials = special_token_ids(tok)
    vocab = hf.config.vocab_size
    print(
        f"model {path}; transformers experts implementation: {hf.config._experts_implementation}; "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    results: dict[str, dict[str, list[float]]] = {}
    for c in (int(x) for x in args.concurrency.split(",")):
        n = args.requests or (2 if c == 1 else c)
        llm = LLM(path, dtype=args.dtype, max_num_seqs=c, max_model_len=args.input_len + args.output_len + 16)
        warm = make_prompts(min(n, 2), 16, vocab, specials, seed=99)
        run_tokenmill(llm, warm, 4)
        run_hf(hf, warm, 4, c, pad_id)
        for rep in range(args.repeats):
            for j, system in enumerate(("tokenmill", "transformers")):
                batch = make_prompts(n, args.input_len, vocab, specials, seed=1000 * c + 10 * rep + j)
                load = os.getloadavg()[0]
                tps = (
                    run_tokenmill(llm, batch, args.output_len)
                    if system == "tokenmill"
                    else run_hf(hf, batch, args.output_len, c, pad_id)
                )
                results.setdefault(str(c), {}).setdefault(system, []).append(tps)
                print(
                    json.dumps(
                        {
                            "concurrency": c,
                            "system": system,
                            "repeat": rep,
                            "output_tok_s": round(tps, 1),
                            "load_1min": [round(load, 1), round(os.getloadavg()[0], 1)],
                        }
                    ),
                    flush=True,
                )
        llm.shutdown()
        del llm
    rows = []
    for c, r in results.items():
        tm, hf_tps = r["tokenmill"], r["transformers"]
        rows.append(
            {
                "concurrency": int(c),
                "tokenmill_tok_s": round(statistics.median(tm), 1),
                "transformers_tok_s": round(statistics.median(hf_tps), 1),
                "ratio": round(statistics.median(a / b for a, b in zip(tm, hf_tps)), 2),
            }
        )
    print(
        f"\n{args.dtype}, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.layers} layers; {args.input_len} in, {args.output_len} out; "
        f"medians of {args.repeats}"
    )
    print("| c | tokenmill tok/s | transformers tok/s | tokenmill / transformers |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['concurrency']} | {row['tokenmill_tok_s']} | {row['transformers_tok_s']} | {row['ratio']}x |")
    out = args.out or str(Path(__file__).parent / "results" / f"moe-{time.strftime('%Y%m%d-%H%M%S')}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(args), "runs": results, "rows": rows}, f, indent=1)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
