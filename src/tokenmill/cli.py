"""`tokenmill generate | chat | serve | bench`: the command line, flags named like vLLM's."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from tokenmill.config import EngineArgs

# Help text per engine flag; every EngineArgs field becomes --field-name.
_ENGINE_HELP = {
    "model": "HF model folder, .gguf file or hub id (default: the built-in SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder, if not the model's",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bfloat16)",
    "device": "cpu (GPU support follows)",
    "max_model_len": "context length (default: the model's)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "GiB of memory for the paged KV cache (default 4)",
    "num_gpu_blocks_override": "exact number of KV blocks (overrides --kv-cache-memory)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "token budget of one engine step (default 2048)",
    "enable_chunked_prefill": "split long prompts across steps",
    "seed": "seed of the sampler for requests without their own seed",
    "num_threads": "intra-op CPU threads (default: all cores)",
    "served_model_name": "model name reported by the API",
}


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    g = p.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model" and positional_model:
            p.add_argument("model_pos", nargs="?", metavar="MODEL", help=_ENGINE_HELP["model"])
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=_ENGINE_HELP.get(f.name))
            continue
        typ = {"int | None": int, "int": int, "float | None": float, "float": float}.get(str(f.type), str)
        g.add_argument(flag, dest=f.name, type=typ, default=f.default, help=_ENGINE_HELP.get(f.name))


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kw = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        kw["model"] = ns.model_pos
    return EngineArgs(**kw)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 for greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible output)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def sampling_params_from(ns: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed, stop=ns.stop,
    )


def _cmd_generate(ns: argparse.Namespace) -> int:
    from tokenmill.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    params = sampling_params_from(ns)
    prompt: str | list[int] = ns.prompt
    if not ns.raw and getattr(llm.get_tokenizer(), "chat_template", None):
        prompt = llm.engine.apply_chat_template([{"role": "user", "content": ns.prompt}])
    last = None
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None and ns.verbose:
        m = last.metrics
        n = len(last.outputs[0].token_ids)
        dt = (m.finished_time or 0) - m.arrival_time
        print(f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s, "
              f"finish_reason={last.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    from tokenmill.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    params = sampling_params_from(ns)
    messages: list[dict] = [{"role": "system", "content": ns.system}] if ns.system else []
    print("tokenmill chat: type a message, /reset to start over, /exit or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = llm.engine.apply_chat_template(messages)
            reply = ""
            for out in llm.stream(ids, params):
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                reply = out.outputs[0].text
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    p.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ...")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print token count and speed to stderr")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)
    add_sampling_args(c)
    c.set_defaults(func=_cmd_chat)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
