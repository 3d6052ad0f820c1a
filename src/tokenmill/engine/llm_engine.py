"""LLMEngine: builds everything from EngineArgs, validates input, and steps the core."""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from tokenmill import progress
from tokenmill.config import (
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WatermarkConfig,
    check_kv_cache_dtype,
    parse_dtype,
    resolve_device,
)
from tokenmill.engine.engine_core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.kernels import cpu_threads
from tokenmill.kv_cache import blocks_held
from tokenmill.lora.adapter import LoRAError, linear_shapes
from tokenmill.lora.config import LoRAConfig, parse_lora_modules
from tokenmill.lora.layers import check_adaptable
from tokenmill.lora.registry import LoRARegistry
from tokenmill.model.layers.attention import LayerAttention, kv_window
from tokenmill.model.layers.quantization import check_quantization, check_w8a8_args
from tokenmill.model.loader import load_hf_config, model_class, model_skeleton, resolve_model_path, served_names
from tokenmill.model.models.llama import sliding_windows
from tokenmill.model.pooling import resolve_task, sentence_transformers_max_len
from tokenmill.model.sharding import check_shardable, check_tp_size
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.request import Request, RequestStatus
from tokenmill.sample.structured_output import StructuredOutputManager
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import GenerationConfig, PretrainedConfig

    from tokenmill.lora.adapter import LoRAAdapter
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import PoolingRequestOutput

logger = logging.getLogger("tokenmill")

DEFAULT_KV_CACHE_GIB = 4.0


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:

        t0 = time.perf_counter()
        tp = args.tensor_parallel_size
        if tp > 1:
            pass  # each rank's threads and cores: worker/executor.py
        elif args.num_threads:
            torch.set_num_threads(args.num_threads)
        else:  # no more threads than the CPU quota / affinity allows (a container's cpu.max)
            cpu_threads.apply_cpu_limit()
        progress.set_phase("finding the model")  # a GGUF file is converted here the first time
        path = resolve_model_path(args.model)
        hf_config = load_hf_config(path)
        check_tp_size(hf_config, tp, check_quantization(args.quantization))
        if tp > 1 or args.enable_lora:  # what the model's modules allow
            skeleton = model_skeleton(hf_config)
            check_shardable(skeleton, tp)
            if args.enable_lora:
                check_adaptable(skeleton)
        check_w8a8_args(args.quantization, args.quantization_calibration, args.enable_lora)
        progress.set_phase("loading the tokenizer")
        self.tokenizer = load_tokenizer(args.tokenizer or path)
        # --task embed (or an encoder): a pooler, and the engine runs embeddings only (model/pooling.py)
        pooler = resolve_task(args.task, model_class(hf_config), path, hf_config, args.override_pooler_config)
        self.task = "generate" if pooler is None else "embed"
        encoder = getattr(model_class(hf_config), "IS_ENCODER", False)
        model_max = getattr(hf_config, "max_position_embeddings", 2048)
        if pooler is not None:
            model_max = min(model_max, sentence_transformers_max_len(path) or model_max)
        max_model_len = args.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max}")
        device = resolve_device(args.device)
        if device != "cpu" and tp > 1 and (device != "cuda" or torch.cuda.device_count() < tp):
            raise ValueError(
                f"--tensor-parallel-size {tp} on GPUs takes GPUs 0..{tp - 1} (one rank each, NCCL): "
                f"{torch.cuda.device_count()} visible; use --device cuda with enough GPUs "
                f"(CUDA_VISIBLE_DEVICES picks them), or --device cpu"
            )
        if args.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling_policy {args.scheduling_policy!r}; choose one of {', '.join(SCHEDULING_POLICIES)}"
            )
        if args.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {args.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        # An encoder's "auto" is its checkpoint's float32: small models whose vectors bf16 would shift.
        dtype = parse_dtype("float32" if encoder and args.dtype == "auto" else args.dtype, device)
        name, aliases = served_names(args.model, args.served_model_name)
        model_config = ModelConfig(
            path,
            hf_config,
            dtype,
            max_model_len,
            name,
            device,
            check_kv_cache_dtype(args.kv_cache_dtype),
            check_quantization(args.quantization),
            args.load_format,
            pooler,
            args.quantization_calibration,
            aliases,
        )

        block_size = args.block_size
        chunked = args.enable_chunked_prefill and not encoder  # an encoder attends over whole sequences
        batched = args.max_num_batched_tokens or (2048 if chunked else max(2048, max_model_len))
        if not chunked and batched < max_model_len:
            raise ValueError(
                f"without chunked prefill{' (an encoder)' if encoder else ''}, max_num_batched_tokens "
                f"must be >= max_model_len"
            )
        # The window every layer slides, as the model will read it from the config (None: some layer
        # reads every key): what one request's blocks are capped by.
        window = kv_window([LayerAttention(sliding_window=w) for w in sliding_windows(hf_config, max_model_len)])
        # An encoder keeps no K/V: its blocks only count tokens, all freed after each step.
        num_blocks = (
            -(-batched // block_size) + args.max_num_seqs + 1
            if encoder
            else self._num_kv_blocks(args, model_config, batched if chunked else max_model_len, window)
        )
        self.config = EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size, num_blocks, args.enable_prefix_caching),
            scheduler=SchedulerConfig(
                args.max_num_seqs,
                batched,
                max_model_len,
                chunked,
                policy=args.scheduling_policy,
                itl_target_ms=args.itl_target_ms or 0.0,
            ),
            seed=args.seed,
            watermark=WatermarkConfig(args.watermark_gamma, args.watermark_delta),
            parallel=ParallelConfig(tp, args.num_threads),
            device=DeviceConfig(args.gpu_memory_utilization, args.enforce_eager),
            speculative=SpeculativeConfig.from_json(args.speculative_config) if args.speculative_config else None,
            lora=_lora_config(args),
        )
        if self.config.lora is not None:
            self.config.scheduler.max_loras = self.config.lora.max_loras
        self.core = EngineCore(self.config)
        self.lora = None  # the adapters by name (lora/registry.py), with --enable-lora
        if self.config.lora is not None:
            self.lora = LoRARegistry(
                self.config.lora, linear_shapes(self.core.runner.model), hf_config.num_hidden_layers, dtype, name
            )
        num_blocks = self.config.cache.num_blocks
        self.output_processor = OutputProcessor(self.tokenizer.backend_tokenizer)
        self.eos_token_ids = _eos_ids(path, self.tokenizer, hf_config)
        self.structured_output = StructuredOutputManager(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        self._ids = itertools.count()
        usable_tokens = (num_blocks - 1) * block_size
        if pooler is not None:
            logger.info(
                "embeddings (--task embed): %s pooling (%s), %snormalized",
                pooler.pooling_type,
                pooler.source,
                "" if pooler.normalize else "not ",
            )
        if encoder:
            logger.info("encoder: no KV cache")
        else:
            logger.info(
                "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max concurrency at max_model_len %d: "
                "%.2fx; prefix caching %s",
                num_blocks - 1,
                block_size,
                usable_tokens,
                num_blocks * block_size * model_config.kv_bytes_per_token() / 2**30,
                dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
                max_model_len,
                (num_blocks - 1) / self.core.kv.max_blocks_held(max_model_len, self._step_tokens(max_model_len)),
                "on" if args.enable_prefix_caching else "off",
            )
        logger.info(
            "engine ready in %.1fs: %s, %s, max_model_len %d", time.perf_counter() - t0, name, dtype, max_model_len
        )

    def _step_tokens(self, num_tokens: int) -> int:
        """The most of a request's num_tokens tokens one step computes: the step's token budget with
        chunked prefill, all of them (a whole prompt, or a preempted request's recompute) without."""
        sched = self.config.scheduler
        return sched.max_num_batched_tokens if sched.enable_chunked_prefill else num_tokens

    @staticmethod
    def _num_kv_blocks(args: EngineArgs, model: ModelConfig, step_tokens: int, window: int | None) -> int:
        """Blocks that fit the --kv-cache-memory budget; refuses a budget that cannot hold one
        request of max_model_len tokens (it could never be served; with a sliding window on every
        layer, what it holds at once: the window's blocks and a step's)."""
        bs = args.block_size
        if args.num_gpu_blocks_override:  # exact count, for tests and experts: no sizing checks
            return args.num_gpu_blocks_override
        if model.device != "cpu" and args.kv_cache_memory is None:
            return 0  # the runner sizes it from --gpu-memory-utilization once the weights are in
        gib = args.kv_cache_memory if args.kv_cache_memory is not None else DEFAULT_KV_CACHE_GIB
        block_bytes = model.kv_bytes_per_token() * bs
        num_blocks = int(gib * 2**30) // block_bytes
        need_blocks = blocks_held(model.max_model_len, step_tokens, bs, window) + 1  # + the null block
        if num_blocks < need_blocks:
            need_gib = math.ceil(need_blocks * block_bytes / 2**30 * 1000) / 1000  # rounded up: it must suffice
            fit = max(num_blocks - 1, 0) * bs
            raise ValueError(
                f"--kv-cache-memory {gib:g} GiB holds {fit} tokens of KV cache, fewer than one request at "
                f"max_model_len {model.max_model_len} needs ({need_gib:.3f} GiB). Raise --kv-cache-memory to "
                f"at least {need_gib:.3f}, or lower --max-model-len" + (f" to at most {fit}" if fit else "") + "."
            )
        return num_blocks

    @classmethod
    def from_args(cls, model: str | None = None, **kwargs: Any) -> LLMEngine:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(EngineArgs(model=model, **kwargs))

    # ---- requests ---------------------------------------------------------------------
    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        parent_id: str | None = None,
        lora_request: LoRARequest | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and tokenize; raises ValueError naming the problem (lora.adapter.LoRAError for
        an adapter that cannot be served: unknown, unreadable, or not for this model). `priority`:
        with the priority scheduling policy, lower runs first; `cache_salt`: the request shares
        prefix-cache blocks only with requests of the same salt."""
        if self.task == "embed":
            raise ValueError(f"{self.config.model.name} runs embeddings (--task embed): it does not generate text")
        self.check_priority(priority)
        adapter = self._adapter(lora_request)
        params = (params or SamplingParams()).clone()
        if params.num_samples > 1:
            raise ValueError(
                "n > 1 or best_of > 1 makes one request per sample: use make_requests (LLM.generate and the server do)"
            )
        cfg = self.config
        text, ids = self._prompt_ids(prompt)
        vocab = cfg.model.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        max_len = cfg.scheduler.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but the model's context length (max_model_len) is "
                f"{max_len}: at most {max_len - 1} prompt tokens leave room for one output token"
            )
        room = max_len - len(ids)
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        kv = self.core.kv
        need = kv.max_blocks_held(len(ids) + params.max_tokens, self._step_tokens(len(ids) + params.max_tokens))
        if need > kv.num_usable_blocks:
            raise ValueError(
                f"the request needs up to {len(ids) + params.max_tokens} tokens ({need} KV blocks) but the "
                f"KV cache holds {kv.num_usable_blocks} blocks; lower max_tokens or raise --kv-cache-memory"
            )
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(
            rid,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            bad_words_token_ids=self._bad_words_ids(params.bad_words or []),
            parent_id=parent_id,
            lora=adapter,
            priority=priority,
            cache_salt=cache_salt,
        )
        if params.guided_decoding is not None:
            req.matcher = self.structured_output.matcher_for(params.guided_decoding)
            if params.min_tokens and self.structured_output.allows_only_eos(req.matcher):
                raise ValueError(
                    f"min_tokens ({params.min_tokens}) cannot be met: the guided decoding "
                    f"constraint only accepts an empty output"
                )
        return req

    def _prompt_ids(self, prompt: str | list[int], truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt, ids checked against the vocabulary. truncate: at most
        this many tokens (text through the tokenizer's truncation, keeping special tokens; ids: the last)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
            if truncate is not None and len(ids) > truncate:
                ids = self.tokenizer(prompt, truncation=True, max_length=truncate)["input_ids"]
        else:
            text, ids = None, list(prompt)[-truncate:] if truncate else list(prompt)
            vocab = self.config.model.vocab_size
            if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    def make_pooling_request(
        self, prompt: str | list[int], params: PoolingParams | None = None, request_id: str | None = None
    ) -> Request:
        """A pooling (embedding) request, validated: --task embed engines only; the prompt fits
        max_model_len (all of it runs; no output token) unless params.truncate_prompt_tokens."""
        if self.task != "embed":
            raise ValueError(
                f"{self.config.model.name} runs generation: embeddings need an embedding model or --task embed"
            )
        params = params or PoolingParams()
        model = self.config.model
        assert model.pooler is not None  # the embed task's
        model.pooler.check_dimensions(params.dimensions, model.name, model.hf_config.hidden_size)
        max_len = self.config.scheduler.max_model_len
        truncate = max_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
        if truncate is not None and truncate > max_len:
            raise ValueError(f"truncate_prompt_tokens {truncate} is over the model's maximum context length {max_len}")
        text, ids = self._prompt_ids(prompt, truncate)
        if len(ids) > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(ids)} tokens in the input for embedding generation. Please reduce the length of "
                f"the input."
            )
        if self.core.kv.max_blocks_held(len(ids), self._step_tokens(len(ids))) > self.core.kv.num_usable_blocks:
            raise ValueError(
                f"the input has {len(ids)} tokens, more than the KV cache holds "
                f"({self.core.kv.num_usable_blocks} blocks); raise --kv-cache-memory"
            )
        rid = request_id if request_id is not None else str(next(self._ids))
        return Request(rid, ids, SamplingParams(max_tokens=1), prompt=text, pooling_params=params)

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs the priority scheduling policy."""
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(
                f"priority {priority} given, but priority scheduling is not enabled (--scheduling-policy priority)"
            )

    def _adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The loaded adapter of a LoRARequest (None: the base model)."""
        if lora_request is None:
            return None
        if self.lora is None:
            raise LoRAError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is off: start the engine "
                f"with enable_lora=True (--enable-lora)"
            )
        return self.lora.get(lora_request)

    def encode(self, text: str, add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
        """Token ids of text; ValueError naming `what` for text the tokenizer cannot take (a lone
        UTF-16 surrogate, which JSON can carry as \\ud800 but UTF-8 cannot)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{what} is not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}"
            ) from None
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as it would appear alone and after a space (vLLM's two spellings)."""
        seqs: list[list[int]] = []
        for word in words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.encode(text, add_special_tokens=False, what="bad_words")
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        parent_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        return self.enqueue(self.make_request(prompt, params, request_id, parent_id, lora_request))

    def make_requests(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> list[Request]:
        """One request per sample: `request_id` itself when n == 1 (and no best_of), else
        `{request_id}-{i}` children sharing it as parent."""
        params = params or SamplingParams()
        if params.num_samples == 1:
            return [self.make_request(prompt, params, request_id, lora_request=lora_request, priority=priority)]
        parent = request_id if request_id is not None else f"p{next(self._ids)}"
        return [
            self.make_request(prompt, child, f"{parent}-{i}", parent, lora_request, priority=priority)
            for i, child in enumerate(params.children())
        ]

    def enqueue(self, req: Request) -> str:
        """Queue a request already built (and validated) by make_request."""
        if req.request_id in self.core.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.output_processor.add_request(req)
        self.core.add_request(req)
        return req.request_id

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        self.core.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (see KVCacheManager.reset_prefix_cache); returns the number of
        block hashes dropped."""
        return self.core.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def check_health(self) -> None:
        """Raises if the engine cannot run a step (a tensor-parallel worker has died)."""
        self.core.runner.check_health()

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any (they also end with this process)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The step's outputs: RequestOutputs, or PoolingRequestOutputs on an embed engine."""
        outputs, stopped = self.output_processor.process(self.core.step())
        for rid in stopped:
            self.core.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        return outputs

    # ---- chat -------------------------------------------------------------------------
    def render_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """The prompt text the chat template makes of messages."""
        if not kw.get("chat_template") and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        text: str = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
        )
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes the special tokens itself)."""
        text = self.render_chat_template(messages, add_generation_prompt, **kw)
        return self.encode(text, add_special_tokens=False, what="the rendered chat")


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    """LoRAConfig from the engine arguments (None without enable_lora)."""
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    if args.tensor_parallel_size > 1:
        raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not supported yet")

    return LoRAConfig(
        args.max_loras,
        args.max_lora_rank,
        args.max_cpu_loras,
        parse_lora_modules(args.lora_modules),
        args.allow_runtime_lora_updating,
        args.lora_path_allowlist,
    )


def _eos_ids(path: str, tokenizer: Any, hf_config: PretrainedConfig) -> frozenset[int]:
    ids: set[int] = set()
    for source in (hf_config, _generation_config(path)):
        e = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _generation_config(path: str) -> GenerationConfig | None:
    if not os.path.exists(os.path.join(path, "generation_config.json")):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a broken generation config only loses extra EOS ids
        return None
