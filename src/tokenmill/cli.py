"""`tokenmill generate | chat | serve | bench | build-kernels`: the command line, flags named like vLLM's."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tokenmill.engine.arg_utils import RUNTIME_LORA_ENV, add_engine_args, engine_args_from
from tokenmill.server.args import ServerArgs


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
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
    )


def _cmd_generate(ns: argparse.Namespace) -> int:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
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
        print(
            f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tokens/s, "
            f"finish_reason={last.outputs[0].finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
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


def _cmd_serve(ns: argparse.Namespace) -> int:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.server.listen import bind_socket

    args = ServerArgs.from_cli_args(ns).with_chat_template_file()
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if ns.allow_runtime_lora_updating and not ns.enable_lora:
        logging.getLogger("tokenmill").warning(
            "--allow-runtime-lora-updating (or %s) without --enable-lora: the LoRA routes stay off", RUNTIME_LORA_ENV
        )
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.server import tracing

    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.server.metrics import check_metrics_prefix

    check_metrics_prefix(args.metrics_prefix)
    traced = tracing.tracing_requested(args.otlp_traces_endpoint)
    if _wants_ray(ns):
        if ns.enable_lora:
            raise ValueError("--enable-lora with Ray Serve replicas is not supported yet")
        if traced or args.metrics_prefix != "tokenmill":
            raise ValueError(
                "--otlp-traces-endpoint and --metrics-prefix with Ray Serve replicas are not supported yet"
            )
        return _serve_on_ray(ns, args)
    # Before the model loads: a missing OpenTelemetry package or a bad protocol fails now.
    tracer = tracing.RequestTracer(args.otlp_traces_endpoint) if traced else None
    try:
        sock = bind_socket(args.host, args.port)  # first: a busy port fails now, not after the model has loaded
    except BaseException:
        if tracer is not None:
            tracer.shutdown()
        raise
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.server.startup import serve

    def load_engine():
        """On the load's thread, while the server already answers /health (503 "loading")."""
        # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
        from tokenmill import progress

        progress.set_phase("importing the engine")
        # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
        from tokenmill.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine.from_args(max_waiting=args.max_waiting, **vars(engine_args_from(ns)))

    return serve(load_engine, args, sock=sock, tracer=tracer)


RAY_FLAGS = ("num_replicas", "min_replicas", "max_replicas", "ray_address")


def _wants_ray(ns: argparse.Namespace) -> bool:
    return any(getattr(ns, f, None) is not None for f in RAY_FLAGS)


def _serve_on_ray(ns: argparse.Namespace, args) -> int:
    """`serve --num-replicas N` (or --ray-address / --min-replicas / --max-replicas): Ray Serve.
    `args`: the ServerArgs (the ingress reads server.args.RAY_INGRESS_FIELDS of them)."""
    try:
        # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
        from tokenmill import ray_serve
    except ImportError as e:
        raise ValueError(f"{e} (needed by --num-replicas / --ray-address)") from None
    replicas = ray_serve.ReplicaOptions(
        num_replicas=ns.num_replicas or ns.min_replicas or 1,
        min_replicas=ns.min_replicas,
        max_replicas=ns.max_replicas,
        target_ongoing_requests=ns.target_ongoing_requests,
        routing=ns.routing,
        max_waiting=args.max_waiting,
        drain_timeout=args.drain_timeout,
    )
    cluster = ray_serve.ClusterOptions(
        ray_address=ns.ray_address,
        host=args.host,
        port=args.port,
        keep_alive_timeout_s=args.timeout_keep_alive,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
    )
    return ray_serve.run_cli(engine_args_from(ns), replicas, args, cluster)


def add_ray_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group(
        "Ray Serve replicas",
        "any of --num-replicas, --min-replicas, --max-replicas or "
        "--ray-address serves through Ray Serve (pip install 'tokenmill[ray]')",
    )
    g.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="engine replicas behind one endpoint, each a full engine with --num-threads threads per "
        "tensor-parallel rank (default without Ray: one engine in this process)",
    )
    g.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscale on ongoing requests, down to this many replicas (>= 1)",
    )
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=16.0,
        help="ongoing requests per replica the autoscaler aims for (default 16)",
    )
    g.add_argument(
        "--routing",
        default="prefix",
        choices=["prefix", "round_robin", "pow2"],
        help="prefix: to the replica most likely holding the prompt's prefix in its cache, else the "
        "least loaded; round_robin; pow2: Serve's power of two choices (default prefix)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting a local Ray on "
        "127.0.0.1; the HTTP proxy listens on --host:--port on the head node",
    )


def _cmd_build_kernels(ns: argparse.Namespace) -> int:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.kernels import cpu_kernels

    t0 = time.perf_counter()
    module = cpu_kernels.load()
    if module is None:
        print(f"tokenmill: error: the CPU kernels did not build: {cpu_kernels.build_error()}", file=sys.stderr)
        return 1
    where = "from the package" if cpu_kernels.origin() == "package" else f"in {cpu_kernels.origin()}"
    print(f"CPU kernels ready: {module.isa()} {where} ({time.perf_counter() - t0:.1f} s)")
    return 0


def _cmd_bench_serve(ns: argparse.Namespace) -> int:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.bench.serve import run_from_args

    return run_from_args(ns)


def add_server_args(s: argparse.ArgumentParser) -> None:
    ServerArgs.add_cli_args(s)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that an unknown flag is reported by the (sub)command it was given
    to: argparse lets subcommands collect unknown arguments and reports them from the top-level
    parser, whose usage ("tokenmill [-h] ... {generate,chat,serve,...}") does not help."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            getattr(ns, _COMMAND_PARSER, self).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


_COMMAND_PARSER = "_command_parser"  # namespace attribute: the innermost subcommand's parser


def _tag_subcommands(p: argparse.ArgumentParser) -> None:
    """Every subcommand's parser puts itself into the namespace (the innermost one wins)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(**{_COMMAND_PARSER: sub})
                _tag_subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill import __version__

    p = _Parser(prog="tokenmill", description="LLM inference and serving engine")
    p.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    p.add_argument(
        "--log-level", default=None, help="DEBUG, INFO, WARNING, ... (default: INFO for serve, WARNING otherwise)"
    )
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

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible (and TGI-compatible) HTTP server",
        description="Serve a model over HTTP: OpenAI's /v1/completions, /v1/chat/completions and /v1/models "
        "(SSE streaming), /tokenize, /detokenize, TGI's /generate and /generate_stream, /health, "
        "/version, /metrics (Prometheus) and /openapi.json.",
    )
    add_engine_args(s, positional_model=True)
    add_server_args(s)
    add_ray_args(s)
    s.set_defaults(func=_cmd_serve, default_log_level="INFO")

    k = sub.add_parser(
        "build-kernels",
        help="load the C++ CPU kernels for this CPU, compiling them if the installation has none for it",
        description="Load the engine's C++ CPU kernels for this CPU's ISA level (or TOKENMILL_CPU_ISA's): "
        "an installed package has them compiled; a source tree, another torch or a level "
        "the build skipped compiles them now (about a minute on 2 cores, once). Prints the "
        "level and where it came from.",
    )
    k.set_defaults(func=_cmd_build_kernels, default_log_level="INFO")

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    bs = b.add_parser(
        "serve",
        help="load generator for any OpenAI-compatible server",
        description="Stream requests to an OpenAI-compatible server and report TTFT, TPOT, ITL, "
        "E2E latency, throughput and goodput.",
    )
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.bench.serve import add_bench_serve_args

    add_bench_serve_args(bs)
    bs.set_defaults(func=_cmd_bench_serve)
    # lazy: a command imports only what it runs (`tokenmill --help` stays fast)
    from tokenmill.bench.offline import add_offline_parsers

    add_offline_parsers(b)
    add_watermark_parsers(sub)
    _tag_subcommands(p)
    return p


def add_watermark_parsers(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("watermark", help="watermark tools").add_subparsers(dest="watermark_command", required=True)
    d = w.add_parser(
        "detect",
        help="z-score of a text against the green-list watermark",
        description="Re-derive each token's green list from the token before it and count green "
        "tokens; prints a JSON score. z > 4 means watermarked with near certainty.",
    )
    d.add_argument("text", nargs="?", help="the text (or use --file)")
    d.add_argument("--file", help="read the text from this file ('-' for stdin)")
    d.add_argument("--model", default=None, help="the model whose tokenizer made the text (default: built-in)")
    d.add_argument("--gamma", type=float, default=0.5, help="the server's --watermark-gamma (default 0.5)")
    d.add_argument("--threshold", type=float, default=4.0, help="z-score above which it is watermarked")
    d.set_defaults(func=_cmd_detect)


def _cmd_detect(ns: argparse.Namespace) -> int:
    import json

    # lazy: the model loader's imports stay out of every other command
    from tokenmill.sample import watermark

    if (ns.text is None) == (ns.file is None):
        raise ValueError("give the text or --file, not both")
    text = ns.text if ns.file is None else (sys.stdin.read() if ns.file == "-" else open(ns.file).read())
    score = watermark.detect_text(text, ns.model, ns.gamma)
    print(
        json.dumps(
            {
                "z_score": round(score.z_score, 3),
                "green_fraction": round(score.green_fraction, 4),
                "num_tokens_scored": score.num_tokens_scored,
                "num_green_tokens": score.num_green_tokens,
                "watermarked": score.detected(ns.threshold),
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    level = ns.log_level or getattr(ns, "default_log_level", "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
