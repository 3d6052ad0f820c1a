"""The engine's command-line flags: every EngineArgs field becomes --field-name (vLLM's
arg_utils), shared by `tokenmill serve`, `generate`, `chat` and the offline benchmarks."""

from __future__ import annotations

import argparse
from dataclasses import fields

from tokenmill import envs
from tokenmill.config import DTYPE_CHOICES, EngineArgs
from tokenmill.spec_decode.config import METHODS as SPECULATIVE_METHODS

# Help text per engine flag; every EngineArgs field becomes --field-name.
_ENGINE_HELP = {
    "model": "HF model folder, .gguf file or hub id (default: the built-in SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder, if not the model's",
    "dtype": f"auto | {' | '.join(DTYPE_CHOICES['cuda'])} (auto: bfloat16); the CPU runs "
    f"{' and '.join(DTYPE_CHOICES['cpu'])}, a GPU {', '.join(DTYPE_CHOICES['cuda'])}",
    "device": "auto | cpu | cuda (auto: cuda when a GPU is visible, else cpu)",
    "max_model_len": "context length (default: the model's)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "GiB of memory for the paged KV cache (default: 4 on the CPU; on a GPU what "
    "--gpu-memory-utilization leaves)",
    "kv_cache_dtype": "auto (the model's dtype) | int8 | fp8 (= fp8_e4m3: float8 e4m3) (per-token, per-head "
    "scales: about half the memory of bfloat16)",
    "quantization": "weight-only quantization: int4 | int8 (groups of 32, quantized at load time) | gguf (keep a "
    "GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as they are); or w8a8 (int8 weights per output channel "
    "and int8 activations per token, SmoothQuant-smoothed); fp8 (weights rounded to e4m3 per channel, run "
    "widened to --dtype); awq | gptq | compressed-tensors | fp8: a checkpoint quantized already (AutoAWQ GEMM "
    "4-bit; GPTQ 4/8-bit, any group size, act-order; llm-compressor's W4A16 / W8A16 / W8A8 / FP8; FP8 with "
    "scales), detected from its config.json's quantization_config without the flag, which then only checks the "
    "format; default: weights in --dtype",
    "quantization_calibration": "with --quantization w8a8: a calibration file for the smoothing factors (.jsonl "
    'lines {"text"}, {"prompt"} or {"messages"}, or plain text; default: a few KB '
    "shipped with tokenmill); the statistics are cached per model",
    "num_gpu_blocks_override": "exact number of KV blocks (overrides --kv-cache-memory)",
    "gpu_memory_utilization": "cuda: fraction of the GPU's memory for this engine: weights, activations (profiled "
    "at start-up), CUDA graphs, and the KV cache in what is left",
    "speculative_config": 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 5}\' (methods: ' + ", ".join(SPECULATIVE_METHODS) + "; draft_model "
    'takes "model": the draft model\'s path); off by default',
    "enforce_eager": "cuda: run every step eagerly (no CUDA graphs for decode steps)",
    "load_format": "auto (the checkpoint's weights) | dummy (random weights: benchmark a model's shape "
    "without its files)",
    "max_num_seqs": "most requests in one batch",
    "max_num_batched_tokens": "token budget of one engine step (default 2048)",
    "scheduling_policy": "fcfs (first come, first served) | priority (requests' `priority`: lower first, ties by "
    "arrival; when KV blocks run out the lowest-priority running request is preempted)",
    "enable_chunked_prefill": "split long prompts across steps",
    "itl_target_ms": "while requests stream tokens, each step takes only the prompt tokens that keep it within "
    "this inter-token latency, measured on this machine as the engine runs (long prompts are "
    "prefilled in smaller chunks between decode steps); 0: every step takes the whole "
    "--max-num-batched-tokens (default: 250 for serve, 0 offline: generate, chat, bench)",
    "watermark_gamma": "green fraction of the vocabulary for watermarked requests (Kirchenbauer et al.)",
    "watermark_delta": "logit bonus of green tokens for watermarked requests",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before (automatic prefix caching)",
    "seed": "seed of the sampler for requests without their own seed",
    "num_threads": "intra-op CPU threads, per tensor-parallel rank (default: all cores, shared out among the ranks)",
    "tensor_parallel_size": "split the model across this many ranks, one process each (Megatron-style shards; "
    "the head counts must divide by it)",
    "task": "auto | generate | embed: what the engine serves, one task per server as vLLM (auto: embed for an "
    "encoder such as BERT, generate for a decoder; embed: a decoder as an embedding model, /v1/embeddings)",
    "override_pooler_config": "with --task embed: how a prompt's hidden states become its embedding, vLLM's JSON "
    '\'{"pooling_type": "MEAN", "normalize": true}\' (pooling_type LAST | MEAN | CLS; '
    "default: the sentence-transformers folder's pooling, else CLS for encoders and LAST "
    "for decoders, normalized)",
    "served_model_name": "model name reported by the API and expected in requests (default: a .gguf file's "
    "general.name if it is a usable id, else the file name without .gguf and its "
    "quantization, e.g. SmolLM2-135M-Instruct; a folder's --model as given; without "
    "--model SmolLM2-135M-Instruct)",
    "enable_lora": "serve LoRA adapters (PEFT folders) over the base model, mixed in one batch; a request "
    'picks one by name (OpenAI: "model", TGI: parameters.adapter_id)',
    "lora_modules": 'adapters served from start-up (with --enable-lora): name=path, or JSON \'{"name": ..., '
    '"path": ..., "base_model_name": ...}\'; several may follow the flag',
    "max_loras": "most distinct LoRA adapters in one batch (slots beside the base weights)",
    "max_lora_rank": "largest LoRA rank accepted (adapters above it are refused)",
    "max_cpu_loras": "LoRA adapters kept loaded in memory, least recently used dropped (and read again when "
    "asked for; default: max(--max-loras, the number of --lora-modules))",
    "allow_runtime_lora_updating": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with "
    "--enable-lora; default: off, or on when VLLM_ALLOW_RUNTIME_LORA_UPDATING is "
    "True or 1)",
    "lora_path_allowlist": "folders LoRA adapters may be read from, their subfolders included (symlinks are "
    "followed, then checked); an adapter path elsewhere is refused with one message "
    "whether or not it exists. Set it when clients may load adapters at run time "
    "(default: anywhere the server can read)",
}

# vLLM's switch for the runtime LoRA routes, honoured as the default of --allow-runtime-lora-updating.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = False) -> None:
    g = p.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "model" and positional_model:
            p.add_argument("model_pos", nargs="?", metavar="MODEL", help=_ENGINE_HELP["model"])
        help_text = _ENGINE_HELP.get(f.name, "")
        if f.default is not None and "default" not in help_text:
            help_text += f" (default: {f.default})"
        if f.name == "lora_modules":  # vLLM's: --lora-modules a=/x b=/y (repeatable here)
            g.add_argument(
                flag, dest=f.name, nargs="+", action="extend", default=None, metavar="NAME=PATH|JSON", help=help_text
            )
            continue
        if f.name == "lora_path_allowlist":  # --lora-path-allowlist /a /b (repeatable)
            g.add_argument(flag, dest=f.name, nargs="+", action="extend", default=None, metavar="DIR", help=help_text)
            continue
        if f.type in ("bool", bool):
            default = f.default or (f.name == "allow_runtime_lora_updating" and envs.value(RUNTIME_LORA_ENV))
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        typ = {"int | None": int, "int": int, "float | None": float, "float": float}.get(str(f.type), str)
        g.add_argument(flag, dest=f.name, type=typ, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    kw = {f.name: getattr(ns, f.name) for f in fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        kw["model"] = ns.model_pos
    return EngineArgs(**kw)
