"""Speculative decoding on input-grounded work: output tok/s with and without drafts, and acceptance.

Workloads built from real text in the Python standard library (no downloads):
- code: "rewrite this function with type hints" over stdlib functions (the answer quotes the input);
- extract: "summarise / extract from this passage" over stdlib module docstrings;
- chat: multi-turn chat whose second turn asks to repeat and extend the first answer.

Each (workload, concurrency, method) runs N requests through the offline engine with
max_num_seqs = concurrency (greedy, chat template, SmolLM2 bf16 by default), in one process,
methods interleaved per repeat, each repeat on prompts of its own (never seen before by any
cache); tok/s is the median over repeats, the speedup the median of the per-repeat ratios. Output
tok/s counts the whole run, prompt processing included (at c=1 the prompts' prefill, which
speculation does not speed up, is a fifth or so of a run without it, so it bounds the ratio). Greedy texts are compared with no speculation (identical means
speculation changed nothing).

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

# Modules whose public, documented functions of 400-2500 characters of source make the workloads
# (about 260 on Python 3.11): every request of a run, and every repeat, gets prompts of its own, so
# neither the prefix cache nor the suffix method's tree of earlier answers sees a prompt twice.
MODULES = [
    "textwrap",
    "shlex",
    "json",
    "fnmatch",
    "string",
    "base64",
    "difflib",
    "calendar",
    "heapq",
    "shutil",
    "glob",
    "html",
    "urllib.parse",
    "colorsys",
    "bisect",
    "posixpath",
    "ntpath",
    "quopri",
    "gettext",
    "locale",
    "tokenize",
    "ast",
    "pprint",
    "reprlib",
    "random",
    "statistics",
    "fractions",
    "csv",
    "email.utils",
    "ipaddress",
    "keyword",
    "linecache",
    "mimetypes",
    "netrc",
    "operator",
    "os",
    "pathlib",
    "platform",
    "plistlib",
    "queue",
    "secrets",
    "shelve",
    "smtplib",
    "sysconfig",
    "tempfile",
    "timeit",
    "traceback",
    "types",
    "typing",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "tarfile",
    "gzip",
    "functools",
    "inspect",
    "dis",
    "copy",
    "enum",
    "dataclasses",
    "argparse",
    "logging",
    "configparser",
    "hashlib",
    "hmac",
    "getopt",
    "optparse",
    "contextlib",
    "abc",
    "codecs",
    "datetime",
    "decimal",
    "numbers",
    "sched",
    "selectors",
    "socket",
    "ssl",
    "subprocess",
    "threading",
]


def _functions() -> list:
    import importlib

    found = []
    for m in MODULES:
        try:
            mod = importlib.import_module(m)
        except Exception:  # noqa: BLE001 - a module this Python lacks
            continue
        for name in sorted(vars(mod)):
            f = getattr(mod, name)
            if name.startswith("_") or not inspect.isfunction(f) or f.__module__ != mod.__name__:
                continue
            try:
                src = inspect.getsource(f)
            except (OSError, TypeError):
                continue
            if 400 <= len(src) <= 2500 and inspect.getdoc(f):
                found.append((f"{m}.{name}", f, src))
    return found


def _module_docs() -> list[str]:
    import importlib

    docs = []
    for m in MODULES:
        try:
            doc = importlib.import_module(m).__doc__ or ""
        except Exception:  # noqa: BLE001
            continue
        if len(doc) >= 300:
            docs.append(doc[:2000])
    return docs


def workloads(n: int, offset: int = 0) -> dict[str, list[list[dict]]]:
    """n conversations per workload, items offset .. offset + n - 1 (wrapping round when a run asks
    for more than there are: ~260 functions, ~45 module docstrings)."""
    funcs, docs = _functions(), _module_docs()
    code, extract, chat = [], [], []
    for i in range(offset, offset + n):
        name, f, src = funcs[i % len(funcs)]
        code.append(
            [
                {
                    "role": "user",
                    "content": "Rewrite this Python function with type hints on every argument "
                    "and the return value. Keep the body as it is.\n\n```python\n" + src + "```",
                }
            ]
        )
        extract.append(
            [
                {
                    "role": "user",
                    "content": "Here is a passage:\n\n"
                    + docs[i % len(docs)]
                    + "\n\nList the functions or classes this passage names, quoting the sentence that "
                    "describes each.",
                }
            ]
        )
        # a different function from the code workload's i-th, so that workloads never share prompts
        name, f, _ = funcs[(i + len(funcs) // 2) % len(funcs)]
        chat.append(
            [
                {"role": "user", "content": f"What does {name} do?"},
                {"role": "assistant", "content": inspect.getdoc(f)[:800]},
                {"role": "user", "content": "Repeat your answer word for word, then add one example call."},
            ]
        )
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

    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "suffix": {"method": "suffix", "num_speculative_tokens": args.k},
        "draft": {
            "method": "draft_model",
            "num_speculative_tokens": args.k,
            "model": args.draft_model or args.model or _default_model(),
            "quantization": args.draft_quantization,
            "dtype": args.draft_dtype,
        },
    }
    methods = ["none"] + [m for m in args.methods.split(",") if m]
    conc = [int(c) for c in args.concurrency.split(",")]
    results = []
    for c in conc:
        n = args.requests or max(2 * c, 4)
        llms = {m: LLM(args.model, dtype=args.dtype, max_num_seqs=c, speculative_config=configs[m]) for m in methods}
        for w in args.workloads.split(","):
            tps_runs: dict[str, list[float]] = {m: [] for m in methods}
            texts: dict[str, list[str]] = {m: [] for m in methods}
            stats: dict[str, list[int]] = {}
            for rep in range(args.repeats):
                convs = workloads(n, offset=rep * n)[w]  # fresh prompts each repeat
                for m in methods:
                    llm = llms[m]
                    d = llm.engine.core.drafter
                    before = (d.stats.num_drafts, d.stats.num_draft_tokens, d.stats.num_accepted_tokens) if d else None
                    dt, out_texts, out_tokens = run(llm, convs, args.max_tokens)
                    tps_runs[m].append(out_tokens / dt)
                    texts[m] += out_texts
                    if d:
                        now = (d.stats.num_drafts, d.stats.num_draft_tokens, d.stats.num_accepted_tokens)
                        stats[m] = [s0 + a - b for s0, a, b in zip(stats.get(m, (0, 0, 0)), now, before)]
            # per repeat: output tok/s of each method on that repeat's prompts; median of the ratios
            for m in methods:
                tps = statistics.median(tps_runs[m])
                ratio = statistics.median(a / b for a, b in zip(tps_runs[m], tps_runs["none"]))
                row = {
                    "workload": w,
                    "concurrency": c,
                    "method": m,
                    "requests": n * args.repeats,
                    "output_tok_s": round(tps, 1),
                    "speedup": round(ratio, 2),
                    "identical_texts": texts[m] == texts["none"],
                    "same_texts": sum(a == b for a, b in zip(texts[m], texts["none"])),
                }
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
        print(
            f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['output_tok_s']} | {r['speedup']}x | "
            f"{r.get('acceptance_rate', '')} | {r.get('acceptance_length', '')} | {r['same_texts']}/{r['requests']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
