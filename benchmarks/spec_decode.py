"""Speculative decoding on input-grounded work: output tok/s with and without drafts, and acceptance.

Workloads built from real text in the Python standard library (no downloads):
- code: "rewrite this function with type hints" over stdlib functions (the answer quotes the input);
- extract: "summarise / extract from this passage" over stdlib module docstrings;
- chat: multi-turn chat whose second turn asks to repeat and extend the first answer.

Each (workload, concurrency, method) runs N requests through the offline engine with
max_num_seqs = concurrency (greedy, chat template, SmolLM2 bf16 by default), in one process,
methods interleaved per repeat; medians of --repeats. Greedy texts are compared with no
speculation (identical means speculation changed nothing).

    python benchmarks/spec_decode.py                               # c = 1, 8, 32; ngram and suffix
    python benchmarks/spec_decode.py --concurrency 1 --workloads code --repeats 3
    python benchmarks/spec_decode.py --methods draft --draft-quantization int4   # the target's own int4 copy drafts
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

FUNCTIONS = ["textwrap.dedent", "shlex.split", "json.dumps", "fnmatch.translate", "textwrap.indent",
             "string.capwords", "base64.b64encode", "difflib.get_close_matches", "calendar.isleap",
             "heapq.nlargest", "shutil.which", "glob.has_magic", "html.escape", "shlex.quote",
             "urllib.parse.urlsplit", "colorsys.rgb_to_hsv"]
MODULES = ["textwrap", "shlex", "fnmatch", "difflib", "heapq", "bisect", "colorsys", "calendar", "glob",
           "html", "string", "base64", "gzip", "zipfile", "tarfile", "csv"]


def _obj(path: str):
    import importlib

    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def workloads(n: int) -> dict[str, list[list[dict]]]:
    import importlib

    code = []
    for i in range(n):
        src = inspect.getsource(_obj(FUNCTIONS[i % len(FUNCTIONS)]))[:2500]
        code.append([{"role": "user", "content": "Rewrite this Python function with type hints on every argument "
                      "and the return value. Keep the body as it is.\n\n```python\n" + src + "```"}])
    extract = []
    for i in range(n):
        doc = (importlib.import_module(MODULES[i % len(MODULES)]).__doc__ or "")[:2000]
        extract.append([{"role": "user", "content": "Here is a passage:\n\n" + doc +
                         "\n\nList the functions or classes this passage names, quoting the sentence that "
                         "describes each."}])
    chat = []
    for i in range(n):
        f = FUNCTIONS[i % len(FUNCTIONS)]
        first = (inspect.getdoc(_obj(f)) or f)[:800]
        chat.append([{"role": "user", "content": f"What does {f} do?"},
                     {"role": "assistant", "content": first},
                     {"role": "user", "content": "Repeat your answer word for word, then add one example call."}])
    return {"code": code, "extract": extract, "chat": chat}


def _default_model() -> str:
    from tokenmill.model.gguf_loader import default_model_path

    return default_model_path()


def run(llm, convs, max_tokens: int) -> tuple[float, list[str], int]:
    from tokenmill import SamplingParams

    prompts = [llm.engine.apply_chat_template(c) for c in convs]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [o.outputs[0].text for o in out], sum(len(o.outputs[0].token_ids) for o in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--workloads", default="code,extract,chat")
    ap.add_argument("--methods", default="ngram,suffix", help="any of ngram, suffix, draft")
    ap.add_argument("--draft-model", default=None, help="draft: the draft model (default: the target itself)")
    ap.add_argument("--draft-quantization", default=None, help="draft: its weights (int8, int4)")
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--requests", type=int, default=0, help="per run (default: 2 x concurrency, at least 4)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args()
    from tokenmill import LLM

    configs = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 5},
               "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
               "draft": {"method": "draft_model", "num_speculative_tokens": args.k,
                         "model": args.draft_model or args.model or _default_model(),
                         "quantization": args.draft_quantization, "dtype": args.draft_dtype}}
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    conc = [int(c) for c in args.concurrency.split(",")]
    work = workloads(max(max(conc) * 2, 4) if not args.requests else args.requests)
    results = []
    for c in conc:
        n = args.requests or max(2 * c, 4)
        llms = {m: LLM(args.model, dtype=args.dtype, max_num_seqs=c, speculative_config=configs[m]) for m in methods}
        for w in args.workloads.split(","):
            convs = work[w][:n]
            times: dict[str, list[float]] = {m: [] for m in methods}
            texts, tokens, stats = {}, {}, {}
            for _ in range(args.repeats):
                for m in methods:
                    llm = llms[m]
                    d = llm.engine.core.drafter
                    before = (d.stats.num_drafts, d.stats.num_draft_tokens, d.stats.num_accepted_tokens) if d else None
                    dt, texts[m], tokens[m] = run(llm, convs, args.max_tokens)
                    times[m].append(dt)
                    if d:
                        stats[m] = [a - b for a, b in zip((d.stats.num_drafts, d.stats.num_draft_tokens,
                                                           d.stats.num_accepted_tokens), before)]
            base = tokens["none"] / statistics.median(times["none"])
            for m in methods:
                tps = tokens[m] / statistics.median(times[m])
                row = {"workload": w, "concurrency": c, "method": m, "requests": n, "output_tok_s": round(tps, 1),
                       "speedup": round(tps / base, 2), "identical_texts": texts[m] == texts["none"],
                       "same_texts": sum(a == b for a, b in zip(texts[m], texts["none"]))}
                if m in stats:
                    drafts, proposed, accepted = stats[m]
                    row["acceptance_rate"] = round(accepted / proposed, 3) if proposed else 0.0
                    row["acceptance_length"] = round(1 + accepted / drafts, 2) if drafts else 1.0
                results.append(row)
                print(json.dumps(row), flush=True)
        for llm in llms.values():
            llm.shutdown()
    print("\n| workload | c | method | output tok/s | vs none | acceptance rate | acceptance length | same texts |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['output_tok_s']} | {r['speedup']}x | "
              f"{r.get('acceptance_rate', '')} | {r.get('acceptance_length', '')} | {r['same_texts']}/{r['requests']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
