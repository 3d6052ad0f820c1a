#!/usr/bin/env python
"""GPU benchmark: batch-1 decode against the HBM bandwidth roofline, and output tokens/s at 1, 64
and 256 concurrent requests, tokenmill (CUDA graphs on and off) against transformers `generate`.

Models: random-weight models of real shapes, built from a config.json written here (no weight
files: tokenmill loads with load_format="dummy", transformers builds the same config with random
init directly on the GPU). Speed does not need trained weights.

  smollm2     SmolLM2-135M's shape (LlamaForCausalLM, hidden 576, 30 layers, 9 / 3 heads, vocab
              49152, tied embeddings)
  llama3-8b   Llama-3-8B's shape (hidden 4096, 32 layers, 32 / 8 heads, intermediate 14336, vocab
              128256, untied)
  tiny        a 2-layer toy (the CPU smoke test: --device cpu --quick)

Each folder also gets a byte-level BPE tokenizer with exactly the model's vocabulary size (ids are
random anyway; the engine detokenizes every token it generates, so the size is realistic).

Measurements, each system in a fresh process (one at a time: each gets the whole GPU):

  bandwidth   device-to-device copy of a --copy-gib buffer, (bytes read + written) / time, median
              of 20 CUDA-event-timed copies. Roofline TPOT = weight bytes streamed per decoded token
              / that bandwidth: every layer matrix, the norms and the LM head once (tied embeddings
              once: the LM head); of the embedding table only the token's row (a lookup, not a
              stream). KV-cache reads (small at these lengths) are not in the roofline; the JSON
              gives them.
  batch-1     --c1-requests prompts one at a time (random ids, --input-len in, --output-len out,
              greedy, EOS ignored): TPOT = (median time for output-len tokens - median time for 1
              token) / (output-len - 1); the engine's own per-request TPOT ((finished - first token)
              / (n - 1)) alongside. fraction = roofline TPOT / measured TPOT (goal >= 0.70).
  throughput  output tokens/s at each --concurrency: c=1 the batch-1 requests above (sequential);
              c>1 c requests submitted at once (tokenmill: one LLM.generate, max_num_seqs >= c;
              transformers: one static batch of c, min_new_tokens = max_new_tokens). Same prompts
              for every system. Goal: tokenmill >= 10x transformers at 64 concurrent.

Every system gets warm-up runs first; --repeats timed runs, medians. Prompts differ between runs,
so tokenmill's prefix cache never hits. Prints markdown tables, writes a JSON result.

    python benchmarks/gpu.py                                      # both models, everything (~7-8 min on an H100)
    python benchmarks/gpu.py --models llama3-8b --out $OUT/gpu.json
    python benchmarks/gpu.py --quick                              # repeats 1, c = 1 and 64
    python benchmarks/gpu.py --hf-concurrency 1,64                # transformers skips 256 (the slowest part)
    python benchmarks/gpu.py --device cpu --quick                 # smoke test of the script without a GPU
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import itertools
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SHAPES = {
    "smollm2": dict(
        label="SmolLM2-135M shape",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "llama3-8b": dict(
        label="Llama-3-8B shape",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
    ),
    "tiny": dict(
        label="tiny 2-layer toy",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    ),
}
SYSTEMS = ("tokenmill", "tokenmill-eager", "hf")
SYSTEM_LABELS = {
    "tokenmill": "tokenmill (CUDA graphs)",
    "tokenmill-eager": "tokenmill (eager)",
    "hf": "transformers generate",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SPECIAL_IDS = (0, 1, 2)  # <|endoftext|> (pad), <|im_start|> (bos), <|im_end|> (eos): never in prompts


def log(msg: str = "") -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------
# model folders: config.json + a tokenizer of the model's vocabulary size
# --------------------------------------------------------------------------------------
def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly vocab_size ids: the 3 specials of the tests' tiny
    models, the 256 byte symbols, then space + 2, 2 and 3 printable ASCII characters (no merges:
    nothing is trained; random ids decode to ASCII text, as a real vocabulary mostly does)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import CHATML, SPECIAL  # the tests' special tokens and chat template

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(SPECIAL) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(SPECIAL) + len(alphabet)} base tokens")
    vocab = {s: i for i, s in enumerate(SPECIAL)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    ascii_ = [chr(b) for b in range(33, 127)]  # printable ASCII: byte-level symbols equal to the bytes
    pairs = ["".join(t) for t in itertools.product(ascii_, repeat=2)]
    fill = itertools.chain(
        ("\u0120" + x for x in pairs),
        pairs,  # \u0120: the byte-level space
        ("".join(t) for t in itertools.product(ascii_, repeat=3)),
    )
    while len(vocab) < vocab_size:
        vocab.setdefault(next(fill), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL[1],
                "eos_token": SPECIAL[2],
                "unk_token": None,
                "pad_token": SPECIAL[0],
                "model_max_length": 131072,
                "chat_template": CHATML,
                "add_bos_token": False,
            }
        )
    )


def write_model_folder(out: Path, name: str, dtype: str) -> Path:
    s = SHAPES[name]
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "initializer_range": 0.02,
        "pad_token_id": SPECIAL_IDS[0],
        "bos_token_id": SPECIAL_IDS[1],
        "eos_token_id": SPECIAL_IDS[2],
        "torch_dtype": dtype,
        "use_cache": True,
        **{k: v for k, v in s.items() if k != "label"},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    write_tokenizer(out, s["vocab_size"])
    return out


def weight_bytes(name: str, dtype: str) -> dict:
    """Parameters of the shape, and the bytes one decoded token streams from memory."""
    s = SHAPES[name]
    h, inter, n_layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    heads, kv, d, vocab = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"], s["vocab_size"]
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * inter + 2 * h  # q,k,v,o, gate/up/down, 2 norms
    layers = n_layers * per_layer
    lm_head = vocab * h
    embed = 0 if s["tie_word_embeddings"] else vocab * h
    params = layers + h + lm_head + embed
    streamed = layers + h + lm_head + h  # + final norm, + one embedding row
    eb = DTYPE_BYTES[dtype]
    return {
        "params": params,
        "params_streamed_per_token": streamed,
        "bytes_per_token": streamed * eb,
        "layer_params": layers,
        "lm_head_params": lm_head,
        "untied_embedding_params": embed,
        "kv_bytes_per_context_token": 2 * n_layers * kv * d * eb,
        "note": "layers + norms + LM head once (tied embeddings counted once); of the embedding table "
        "one row per token; KV-cache reads not included",
    }


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    lo = max(SPECIAL_IDS) + 1
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


def prompt_seed(c: int, repeat: int, kind: str = "run") -> int:
    base = {"run": 0, "ttft": 1_000_000, "warm": 2_000_000}[kind]
    return base + 1000 * c + repeat


# --------------------------------------------------------------------------------------
# workers (one process per system and model)
# --------------------------------------------------------------------------------------
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if len(self.lines) < 300:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _write(path: str, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


def worker_bandwidth(spec: dict) -> dict:
    import torch

    dev = spec["device"]
    facts = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    try:
        facts["triton"] = _md.version("triton")
    except _md.PackageNotFoundError:
        facts["triton"] = None
    if dev.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count,
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
        )
    n = int(spec["copy_gib"] * 2**30) if dev.startswith("cuda") else 256 * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        if dev.startswith("cuda"):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        if i >= 5:
            times.append(dt)
    med = statistics.median(times)
    return {
        "bytes_copied": n,
        "copy_s_median": med,
        "bandwidth_GBps": 2 * n / med / 1e9,
        "bandwidth_GBps_best": 2 * n / min(times) / 1e9,
        "copies_timed": len(times),
        "method": "torch copy_ of a uint8 buffer, CUDA events, (read + write) bytes / time, median of 20",
        "machine": facts,
    }


def worker_tokenmill(spec: dict, out_path: str) -> dict:
    import torch

    dev, out_len, in_len = spec["device"], spec["output_len"], spec["input_len"]
    vocab = SHAPES[spec["model"]]["vocab_size"]
    cap = _Capture()
    logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message)s")
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    logging.getLogger("tokenmill").addHandler(cap)
    try:
        from tokenmill import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"cannot import tokenmill ({e}): install it, or put src/ on PYTHONPATH") from e

    res: dict = {"system": spec["system"], "device": dev, "enforce_eager": spec["enforce_eager"]}
    kw = dict(
        device=dev,
        dtype=spec["dtype"],
        max_num_seqs=max(spec["concurrency"]),
        max_model_len=spec["max_model_len"],
        load_format="dummy",
        seed=0,
    )
    if dev.startswith("cuda"):
        kw.update(enforce_eager=spec["enforce_eager"], gpu_memory_utilization=spec["gpu_memory_utilization"])
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    res["engine_args"] = kw
    t0 = time.perf_counter()
    try:
        llm = LLM(model=spec["path"], **kw)
    except TypeError as e:  # an engine without one of the GPU arguments
        raise SystemExit(
            f"tokenmill.LLM does not take these arguments yet ({e}); its GPU arguments "
            f"(device, enforce_eager, gpu_memory_utilization, load_format='dummy') is needed"
        ) from e
    res["load_s"] = round(time.perf_counter() - t0, 2)
    res["engine_log"] = cap.lines
    res["cuda_graph_log"] = [ln for ln in cap.lines if "graph" in ln.lower() or "captur" in ln.lower()]
    log(f"    engine ready in {res['load_s']} s (includes random init and, with graphs, capture)")

    def gen(prompts, n):
        sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        _sync(dev)
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        _sync(dev)
        dt = time.perf_counter() - t
        lens = [len(o.outputs[0].token_ids) for o in outs]
        if any(x != n for x in lens):
            raise RuntimeError(f"asked for {n} tokens per request, got lengths {sorted(set(lens))}")
        tpots, ttfts = [], []
        for o in outs:
            m = getattr(o, "metrics", None)
            if m is not None and m.first_token_time is not None and m.finished_time is not None:
                ttfts.append(m.first_token_time - m.arrival_time)
                if n > 1:
                    tpots.append((m.finished_time - m.first_token_time) / (n - 1))
        return dt, outs, (statistics.mean(tpots) if tpots else None), (statistics.mean(ttfts) if ttfts else None)

    run_tokens: dict = {}
    res["concurrency"] = {}
    for c in spec["concurrency"]:
        log(f"    c={c}: warm-up ...")
        warm = make_prompts(c, in_len, vocab, prompt_seed(c, 0, "warm"))
        if c == 1:  # two requests of up to 32 tokens and a 1-token one, each on its own prompt
            warm = make_prompts(3, in_len, vocab, prompt_seed(c, 0, "warm"))
            gen([warm[0]], min(out_len, 32))
            gen([warm[1]], min(out_len, 32))
            gen([warm[2]], 1)
        else:
            gen(warm, min(8, out_len))
        r: dict = {"runs_s": [], "tok_s": [], "engine_tpot_s": [], "engine_ttft_s": []}
        for rep in range(spec["repeats"]):
            if c == 1:
                prompts = make_prompts(spec["c1_requests"], in_len, vocab, prompt_seed(1, rep))
                walls = []
                for k, p in enumerate(prompts):
                    dt, outs, tpot, ttft = gen([p], out_len)
                    walls.append(dt)
                    r["engine_tpot_s"].append(tpot)
                    r["engine_ttft_s"].append(ttft)
                    if rep == 0 and k == 0:
                        run_tokens[str(c)] = [list(outs[0].outputs[0].token_ids[:16])]
                r.setdefault("request_s", []).extend(walls)
                for p in make_prompts(spec["c1_requests"], in_len, vocab, prompt_seed(1, rep, "ttft")):
                    dt, _, _, _ = gen([p], 1)
                    r.setdefault("one_token_s", []).append(dt)
                wall = sum(walls)
                n_tok = len(prompts) * out_len
            else:
                prompts = make_prompts(c, in_len, vocab, prompt_seed(c, rep))
                wall, outs, tpot, ttft = gen(prompts, out_len)
                r["engine_tpot_s"].append(tpot)
                r["engine_ttft_s"].append(ttft)
                if rep == 0:
                    run_tokens[str(c)] = [list(o.outputs[0].token_ids[:16]) for o in outs[:8]]
                n_tok = c * out_len
            r["runs_s"].append(round(wall, 4))
            r["tok_s"].append(round(n_tok / wall, 2))
            log(f"    c={c} run {rep + 1}/{spec['repeats']}: {wall:.2f} s, {n_tok / wall:.1f} output tok/s")
        r["output_tok_s"] = _med(r["tok_s"])
        r["engine_tpot_ms"] = None if _med(r["engine_tpot_s"]) is None else 1e3 * _med(r["engine_tpot_s"])
        r["engine_ttft_ms"] = None if _med(r["engine_ttft_s"]) is None else 1e3 * _med(r["engine_ttft_s"])
        if c == 1:
            full, one = _med(r["request_s"]), _med(r["one_token_s"])
            r["request_ms_median"], r["one_token_ms_median"] = 1e3 * full, 1e3 * one
            r["tpot_ms"] = 1e3 * (full - one) / (out_len - 1) if out_len > 1 else None
        res["concurrency"][str(c)] = r
        res["sample_tokens"] = run_tokens
        if dev.startswith("cuda"):
            res["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        res["engine_log"] = cap.lines
        res["cuda_graph_log"] = [ln for ln in cap.lines if "graph" in ln.lower() or "captur" in ln.lower()]
        _write(out_path, res | {"partial": True})
    try:
        llm.shutdown()
    except Exception:  # noqa: BLE001 - the figures are in; a failing shutdown is only reported
        res["shutdown_error"] = traceback.format_exc(limit=3)
    return res


def hf_from_config(cfg, dtype, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        try:  # transformers >= 4.56 calls it dtype; older ones torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    p = next(model.parameters())
    if p.dtype != dtype or p.device.type != torch.device(device).type:
        log(f"    (transformers built the model as {p.dtype} on {p.device}; moving to {dtype} on {device})")
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def worker_hf(spec: dict, out_path: str) -> dict:
    import torch
    import transformers
    from transformers import AutoConfig

    dev, out_len, in_len = spec["device"], spec["output_len"], spec["input_len"]
    vocab = SHAPES[spec["model"]]["vocab_size"]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec["dtype"]]
    cfg = AutoConfig.from_pretrained(spec["path"])
    if spec.get("hf_attn"):
        cfg._attn_implementation = spec["hf_attn"]
    t0 = time.perf_counter()
    model = hf_from_config(cfg, dtype, dev)
    res: dict = {
        "system": "hf",
        "device": dev,
        "transformers": transformers.__version__,
        "load_s": round(time.perf_counter() - t0, 2),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "concurrency": {},
    }
    log(f"    model built in {res['load_s']} s (random init on {dev}, {res['attn_implementation']} attention)")
    pad = SPECIAL_IDS[0]

    def gen(prompts, n):
        ids = torch.tensor(prompts, dtype=torch.long, device=dev)  # equal lengths: no padding needed
        mask = torch.ones_like(ids)
        _sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
            )
        _sync(dev)
        dt = time.perf_counter() - t
        if out.shape[1] - ids.shape[1] != n:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, asked for {n}")
        return dt, out[:, ids.shape[1] :]

    for c in spec["hf_concurrency"]:
        log(f"    c={c}: warm-up ...")
        warm = make_prompts(c, in_len, vocab, prompt_seed(c, 0, "warm"))
        r: dict = {"runs_s": [], "tok_s": [], "batch_size": c}
        try:
            if c == 1:
                warm = make_prompts(3, in_len, vocab, prompt_seed(c, 0, "warm"))
                gen([warm[0]], min(out_len, 32))
                gen([warm[1]], min(out_len, 32))
                gen([warm[2]], 1)
            else:
                gen(warm, min(8, out_len))
            for rep in range(spec["hf_repeats"]):
                if c == 1:
                    prompts = make_prompts(spec["c1_requests"], in_len, vocab, prompt_seed(1, rep))
                    walls = [gen([p], out_len)[0] for p in prompts]
                    r.setdefault("request_s", []).extend(walls)
                    for p in make_prompts(spec["c1_requests"], in_len, vocab, prompt_seed(1, rep, "ttft")):
                        r.setdefault("one_token_s", []).append(gen([p], 1)[0])
                    wall, n_tok = sum(walls), len(prompts) * out_len
                else:
                    prompts = make_prompts(c, in_len, vocab, prompt_seed(c, rep))
                    wall, _ = gen(prompts, out_len)
                    n_tok = c * out_len
                r["runs_s"].append(round(wall, 4))
                r["tok_s"].append(round(n_tok / wall, 2))
                log(f"    c={c} run {rep + 1}/{spec['hf_repeats']}: {wall:.2f} s, {n_tok / wall:.1f} output tok/s")
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) as e:
            r["error"] = f"out of GPU memory: {str(e)[:300]}"
            log(f"    c={c}: OUT OF MEMORY ({str(e)[:200]})")
        if r["tok_s"]:
            r["output_tok_s"] = _med(r["tok_s"])
            if c == 1:
                full, one = _med(r["request_s"]), _med(r["one_token_s"])
                r["request_ms_median"], r["one_token_ms_median"] = 1e3 * full, 1e3 * one
                r["tpot_ms"] = 1e3 * (full - one) / (out_len - 1) if out_len > 1 else None
        res["concurrency"][str(c)] = r
        if dev.startswith("cuda"):
            res["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.empty_cache()
        _write(out_path, res | {"partial": True})
    return res


def worker_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out_path = spec["result_path"]
    if spec["device"].startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"worker: no CUDA GPU visible to torch {torch.__version__}")
    kind = spec["kind"]
    if kind == "bandwidth":
        res = worker_bandwidth(spec)
    elif kind == "tokenmill":
        res = worker_tokenmill(spec, out_path)
    elif kind == "hf":
        res = worker_hf(spec, out_path)
    else:
        raise SystemExit(f"unknown worker kind {kind}")
    _write(out_path, res)


def run_worker(spec: dict, workdir: Path, tag: str, timeout: float) -> dict:
    spec_path = workdir / f"{tag}.spec.json"
    spec["result_path"] = str(workdir / f"{tag}.result.json")
    Path(spec["result_path"]).unlink(missing_ok=True)
    _write(str(spec_path), spec)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    src = str(REPO / "src")
    if src not in env.get("PYTHONPATH", "").split(os.pathsep):  # tokenmill from this checkout, installed or not
        env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), src) if p])
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--_worker", str(spec_path)], env=env, timeout=timeout
        ).returncode
        err = None if rc == 0 else f"worker exited with status {rc} (its output is above)"
    except subprocess.TimeoutExpired:
        err = f"worker killed after --worker-timeout {timeout:.0f} s"
    res = json.loads(Path(spec["result_path"]).read_text()) if Path(spec["result_path"]).exists() else {}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    if err:
        res["error"] = err
        log(f"  !! {tag}: {err}")
    return res


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------
def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def _agreement(a: dict, b: dict) -> dict | None:
    """First-16-token agreement of the sample rows two tokenmill runs share (same seeded weights)."""
    rows = same = prefix = 0
    for c, ra in a.items():
        for x, y in zip(ra, b.get(c, [])):
            rows += 1
            same += x == y
            k = 0
            while k < min(len(x), len(y)) and x[k] == y[k]:
                k += 1
            prefix += k
    return {"rows": rows, "identical": same, "mean_common_prefix": round(prefix / rows, 1)} if rows else None


def summarize(result: dict, args) -> list[str]:
    if args.device == "cpu":
        SYSTEM_LABELS["tokenmill"] = "tokenmill"
    bw = result.get("bandwidth", {}).get("bandwidth_GBps")
    lines = []
    lines.append(
        f"Copy bandwidth: {_fmt(bw, '.0f')} GB/s (device-to-device copy of "
        f"{args.copy_gib} GiB, read + write bytes / time, median)"
    )
    lines.append(
        "Weight bytes per token: layer matrices + norms + LM head once (tied embeddings once), one "
        "embedding row; KV reads excluded."
    )
    lines.append("")
    lines.append(
        "| model | weight GB/token | roofline TPOT ms | system | TPOT ms | fraction of roofline | "
        "engine TPOT ms | TTFT ms (1 token) |"
    )
    lines.append("|---|---:|---:|---|---:|---:|---:|---:|")
    for name, m in result["models"].items():
        wb = m["weights"]["bytes_per_token"]
        roof = wb / (bw * 1e9) * 1e3 if bw else None
        m["roofline_tpot_ms"] = roof
        for sysname in args.systems:
            s = m["systems"].get(sysname, {})
            c1 = s.get("concurrency", {}).get("1", {})
            tpot = c1.get("tpot_ms")
            frac = roof / tpot if roof and tpot else None
            c1["fraction_of_roofline"] = frac
            lines.append(
                f"| {name} | {wb / 1e9:.3f} | {_fmt(roof, '.3f')} | {SYSTEM_LABELS[sysname]} | "
                f"{_fmt(tpot, '.3f')} | {_fmt(frac, '.1%')} | {_fmt(c1.get('engine_tpot_ms'), '.3f')} | "
                f"{_fmt(c1.get('one_token_ms_median'), '.1f')} |" + (f" error: {s['error']}" if s.get("error") else "")
            )
    lines.append("")
    lines.append(
        f"Output tokens/s, {args.input_len} random tokens in / {args.output_len} out, greedy, EOS "
        f"ignored; c=1: {args.c1_requests} requests one after another; median of {args.repeats} "
        f"(transformers {args.hf_repeats})."
    )
    lines.append("")
    lines.append(
        "| model | concurrency | tokenmill (graphs) | tokenmill (eager) | transformers (static batch) | "
        "tokenmill / transformers | graphs / eager |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in result["models"].items():
        for c in args.concurrency:
            v = {s: m["systems"].get(s, {}).get("concurrency", {}).get(str(c), {}).get("output_tok_s") for s in SYSTEMS}
            hf_err = m["systems"].get("hf", {}).get("concurrency", {}).get(str(c), {}).get("error")
            ratio = v["tokenmill"] / v["hf"] if v["tokenmill"] and v["hf"] else None
            ge = v["tokenmill"] / v["tokenmill-eager"] if v["tokenmill"] and v["tokenmill-eager"] else None
            m.setdefault("ratios", {})[str(c)] = {"tokenmill/hf": ratio, "graphs/eager": ge}
            hf_cell = (
                _fmt(v["hf"])
                if v["hf"]
                else ("OOM" if hf_err and "memory" in hf_err else ("not run" if c not in args.hf_concurrency else "-"))
            )
            lines.append(
                f"| {name} | {c} | {_fmt(v['tokenmill'])} | {_fmt(v['tokenmill-eager'])} | {hf_cell} | "
                f"{_fmt(ratio, '.2f')}{'x' if ratio else ''} | {_fmt(ge, '.2f')}{'x' if ge else ''} |"
            )
    lines.append("")
    goals = {}
    for name, m in result["models"].items():
        c1 = m["systems"].get("tokenmill", {}).get("concurrency", {}).get("1", {})
        frac = c1.get("fraction_of_roofline")
        r64 = m.get("ratios", {}).get("64", {}).get("tokenmill/hf")
        goals[name] = {
            "batch1_fraction_of_roofline": frac,
            "batch1_goal_0.70": None if frac is None else frac >= 0.70,
            "ratio_vs_hf_at_64": r64,
            "ratio_goal_10x": None if r64 is None else r64 >= 10,
        }
        verdict = lambda ok: "n/a" if ok is None else ("MET" if ok else "NOT MET")  # noqa: E731
        lines.append(
            f"Goals, {name}: batch-1 decode {_fmt(frac, '.1%')} of the roofline (goal >= 70%: "
            f"{verdict(goals[name]['batch1_goal_0.70'])}); tokenmill / transformers at 64 concurrent "
            f"{_fmt(r64, '.2f')}x (goal >= 10x: {verdict(goals[name]['ratio_goal_10x'])})"
        )
        a = _agreement(
            m["systems"].get("tokenmill", {}).get("sample_tokens", {}),
            m["systems"].get("tokenmill-eager", {}).get("sample_tokens", {}),
        )
        if a:
            m["graphs_vs_eager_tokens"] = a
            lines.append(
                f"  graphs vs eager, same seeded weights, first 16 greedy tokens of {a['rows']} sample rows: "
                f"{a['identical']} identical, mean common prefix {a['mean_common_prefix']}"
            )
        for sysname in args.systems:
            glog = m["systems"].get(sysname, {}).get("cuda_graph_log")
            if glog:
                lines.append(f"  {sysname} engine log on graphs: " + " | ".join(glog[:3]))
    result["goals"] = goals
    return lines


def machine_facts() -> dict:
    facts = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    for pkg in ("torch", "triton", "transformers", "tokenizers"):
        try:
            facts[pkg] = _md.version(pkg)
        except _md.PackageNotFoundError:
            facts[pkg] = None
    if shutil.which("nvidia-smi"):
        try:
            facts["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        facts["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=5
            ).stdout.strip()
            or None
        )
        facts["git_src_dirty"] = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True, cwd=REPO, timeout=5
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        facts["git_commit"] = None
    return facts


def _ints(s: str) -> list[int]:
    return sorted({int(x) for x in s.split(",") if x.strip()})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cuda (default; fails at once without a GPU) or cpu (a smoke test of the script)",
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated of {','.join(SHAPES)} (default: smollm2,llama3-8b; tiny with --device cpu)",
    )
    p.add_argument(
        "--systems", default=None, help=f"comma-separated of {','.join(SYSTEMS)} (default: all; on cpu tokenmill,hf)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--concurrency", default=None, help="comma-separated (default 1,64,256; --quick 1,64)")
    p.add_argument(
        "--hf-concurrency",
        default=None,
        help="the concurrencies transformers runs (default: all of --concurrency); e.g. 1,64 to skip "
        "its slowest part (256 on the 8B shape)",
    )
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 256)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement, medians (default 3)")
    p.add_argument("--hf-repeats", type=int, default=None, help="timed transformers runs (default: --repeats)")
    p.add_argument(
        "--c1-requests", type=int, default=None, help="requests run one after another per batch-1 repeat (default 2)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smaller run: repeats 1, one batch-1 request, c = 1 and 64 (on cpu: 1 and 4, 32 in / 16 out)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokenmill's (default: the engine's)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: input-len + output-len")
    p.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: its own choice, sdpa)")
    p.add_argument("--copy-gib", type=float, default=2.0, help="buffer size of the bandwidth measurement")
    p.add_argument(
        "--worker-timeout",
        type=float,
        default=420.0,
        help="seconds one system on one model may take before it is killed (its finished figures stay)",
    )
    p.add_argument("--workdir", default=None, help="where the model folders go (default: a temp folder, removed)")
    p.add_argument("--out", default=None, help="JSON result (default: benchmarks/results/gpu-<timestamp>.json)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._worker:
        return a
    cpu = a.device == "cpu"
    a.models = [x.strip() for x in (a.models or ("tiny" if cpu else "smollm2,llama3-8b")).split(",") if x.strip()]
    a.systems = [
        x.strip() for x in (a.systems or ("tokenmill,hf" if cpu else ",".join(SYSTEMS))).split(",") if x.strip()
    ]
    for m in a.models:
        if m not in SHAPES:
            p.error(f"unknown model {m!r}; choose from {', '.join(SHAPES)}")
    for s in a.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    a.concurrency = _ints(a.concurrency or ("1,4" if cpu and a.quick else "1,64" if a.quick else "1,64,256"))
    a.hf_concurrency = _ints(a.hf_concurrency) if a.hf_concurrency else list(a.concurrency)
    a.input_len = a.input_len or (32 if cpu and a.quick else 256)
    a.output_len = a.output_len or (16 if cpu and a.quick else 128)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.hf_repeats = a.hf_repeats or a.repeats
    a.c1_requests = a.c1_requests or (1 if a.quick else 2)
    a.max_model_len = a.max_model_len or a.input_len + a.output_len
    if min(a.concurrency) < 1 or a.output_len < 2 or a.input_len < 1:
        p.error("concurrency >= 1, output-len >= 2, input-len >= 1")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        worker_main(args._worker)
        return 0
    t_start = time.perf_counter()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks/gpu.py: no CUDA GPU is visible to torch {torch.__version__} "
            f"(a CPU build, or no driver). This benchmark is for a GPU machine; "
            f"--device cpu --quick runs a smoke test of the script itself."
        )
    out = Path(args.out) if args.out else HERE / "results" / f"gpu-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tokenmill-gpu-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("_worker", "out")}
    result = {
        "benchmark": "gpu",
        "timestamp": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/gpu.py"] + sys.argv[1:]),
        "config": config,
        "machine": machine_facts(),
        "models": {},
    }

    def save(final: bool = False) -> None:
        out.write_text(json.dumps(result | ({} if final else {"partial": True}), indent=1, default=str) + "\n")

    log(
        f"benchmarks/gpu.py on {args.device}: models {args.models}, systems {args.systems}, concurrency "
        f"{args.concurrency} (transformers {args.hf_concurrency}), {args.input_len} in / {args.output_len} out, "
        f"repeats {args.repeats}, {args.dtype}"
    )
    log(
        f"machine: {result['machine'].get('nvidia_smi') or platform.processor() or '-'}; torch "
        f"{result['machine']['torch']}, triton {result['machine']['triton']}, transformers "
        f"{result['machine']['transformers']}"
    )
    log("[bandwidth] device-to-device copy ...")
    result["bandwidth"] = run_worker(
        {"kind": "bandwidth", "device": args.device, "copy_gib": args.copy_gib},
        workdir,
        "bandwidth",
        args.worker_timeout,
    )
    bw = result["bandwidth"].get("bandwidth_GBps")
    log(f"[bandwidth] {_fmt(bw, '.0f')} GB/s (read + write), {result['bandwidth'].get('machine', {})}")
    save()
    errors = 0 if bw else 1
    for name in args.models:
        t_model = time.perf_counter()
        path = write_model_folder(workdir / name, name, args.dtype)
        wb = weight_bytes(name, args.dtype)
        m = result["models"][name] = {"shape": SHAPES[name], "path": str(path), "weights": wb, "systems": {}}
        log(
            f"\n[{name}] {SHAPES[name]['label']}: {wb['params'] / 1e9:.3f} B params, "
            f"{wb['bytes_per_token'] / 1e9:.3f} GB streamed per decoded token"
            + (f", roofline TPOT {wb['bytes_per_token'] / (bw * 1e9) * 1e3:.3f} ms" if bw else "")
        )
        for sysname in args.systems:
            log(f"[{name}] {SYSTEM_LABELS[sysname] if args.device == 'cuda' else sysname} ...")
            spec = {
                "model": name,
                "path": str(path),
                "device": args.device,
                "dtype": args.dtype,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "repeats": args.repeats,
                "c1_requests": args.c1_requests,
                "concurrency": args.concurrency,
                "system": sysname,
                "max_model_len": args.max_model_len,
            }
            if sysname == "hf":
                spec.update(
                    kind="hf", hf_concurrency=args.hf_concurrency, hf_repeats=args.hf_repeats, hf_attn=args.hf_attn
                )
            else:
                spec.update(
                    kind="tokenmill",
                    enforce_eager=sysname == "tokenmill-eager",
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                )
            r = m["systems"][sysname] = run_worker(spec, workdir, f"{name}-{sysname}", args.worker_timeout)
            errors += bool(r.get("error"))
            log(f"[{name}] {sysname} done in {r['wall_s']} s")
            save()
        m["wall_s"] = round(time.perf_counter() - t_model, 1)

    lines = summarize(result, args)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    result["errors"] = errors
    result["report_markdown"] = "\n".join(lines)
    log("")
    for ln in lines:
        log(ln)
    log(
        f"\ntotal {result['total_s']} s; per model: "
        + ", ".join(f"{n} {m['wall_s']} s" for n, m in result["models"].items())
    )
    save(final=True)
    log(f"wrote {out}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        log(f"FAILED: {errors} measurement(s) did not complete; see the errors above and in the JSON")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
