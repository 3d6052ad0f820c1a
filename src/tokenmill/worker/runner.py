"""ModelRunner: owns the model and the KV cache tensor; runs one flat batch per step.

Under tensor parallelism every rank has a ModelRunner over its shard (and its kv heads' share
of the cache): rank 0's prepares each step and sends it to the workers (`workers`), then all
ranks `run` it; only rank 0 gets logits and samples.
"""

from __future__ import annotations

import functools
import gc
import logging
from typing import TYPE_CHECKING, Any

import torch

from tokenmill import envs, progress
from tokenmill.config import DeviceConfig, ModelConfig, SchedulerConfig, WatermarkConfig
from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.kernels import cpu_kernels
from tokenmill.kernels.memory import huge_page_empty, populate_in_background
from tokenmill.lora.layers import LoRASlots
from tokenmill.model.layers.attention import AttentionBackend, SeqChunk, index_tensor
from tokenmill.model.loader import load_model
from tokenmill.model.pooling import Pooler, PoolingMetadata
from tokenmill.sample.sampler import Sampler, SamplerOutput, SamplingBatches, score_tokens
from tokenmill.sample.verify import verify_drafts
from tokenmill.step import SchedulerOutput
from tokenmill.worker import gpu_memory
from tokenmill.worker.cuda_graphs import CudaGraphDecode
from tokenmill.worker.fused_decode import FusedDecode
from tokenmill.worker.staging import PinnedStaging, StepInputs

if TYPE_CHECKING:
    from tokenmill.lora.config import LoRAConfig
    from tokenmill.model.layers.gpu_attention import TritonAttentionBackend
    from tokenmill.worker.executor import TPWorkers

logger = logging.getLogger("tokenmill")


def attention_backend_for(device: torch.device) -> type[AttentionBackend] | type[TritonAttentionBackend]:
    """The C++ kernels on the CPU, Triton on a GPU; TOKENMILL_ATTENTION_BACKEND=triton runs the
    Triton one on the CPU too (set TRITON_INTERPRET=1 before triton is imported: CI's test of it)."""
    choice = envs.TOKENMILL_ATTENTION_BACKEND or ("triton" if device.type == "cuda" else "cpu")
    if choice not in ("cpu", "triton"):
        raise ValueError(f"TOKENMILL_ATTENTION_BACKEND={choice!r}: choose cpu or triton")
    if choice == "cpu" and device.type != "cpu":
        raise ValueError("the C++ attention kernels run on the CPU only")
    if choice == "cpu":
        return AttentionBackend
    # lazy: imports triton, which a CPU never needs
    from tokenmill.model.layers.gpu_attention import TritonAttentionBackend

    return TritonAttentionBackend


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        watermark: WatermarkConfig | None = None,
        tp: TPGroup = NO_TP,
        workers: TPWorkers | None = None,
        device_config: DeviceConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """num_blocks 0: as many as fit the GPU's memory budget (--gpu-memory-utilization)."""
        self.config = model_config
        self.block_size = block_size
        self.device = torch.device(model_config.device)
        self.tp, self.workers = tp, workers  # workers: rank 0's TPWorkers (worker/executor.py)
        self.device_config = device_config or DeviceConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        # a model/models class (an nn.Module): its forward, compute_logits and final_hidden are called by name
        model: Any = load_model(
            model_config.path,
            model_config.hf_config,
            model_config.dtype,
            model_config.max_model_len,
            self.device,
            model_config.quantization,
            tp,
            model_config.load_format,
            model_config.quantization_calibration,
        )
        self.model = model
        self.backend = attention_backend_for(self.device)
        # An encoder (BERT) attends within whole sequences and keeps no K/V: no cache, no decode steps.
        self.encoder = getattr(self.model, "IS_ENCODER", False)
        self.pooler = Pooler(model_config.pooler, self.model.final_hidden) if model_config.pooler else None
        # Index tensors go to a GPU in one pinned copy per step; on the CPU they are used as built.
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.fast_decode: FusedDecode | CudaGraphDecode | None = (
            None  # a decode-only step's fast path: the fused C++ step, or CUDA graphs
        )
        self.lora: LoRASlots | None = (
            None  # the adapters' slots beside the linears (lora/layers.py), with --enable-lora;
        )
        # set before the GPU's memory-profiling step and graph capture, which run the model
        # Not under tensor parallelism: NCCL calls inside captured graphs are left for when they can be tested.
        self.cuda_graphs = (
            self.device.type == "cuda" and not self.device_config.enforce_eager and tp.size == 1 and not self.encoder
        )
        if self.device.type == "cuda" and tp.size > 1 and not self.device_config.enforce_eager and tp.rank == 0:
            logger.info("CUDA graphs: off under tensor parallelism (decode steps run eagerly)")
        if num_blocks == 0:  # every rank sizes its own GPU; all take the smallest count
            num_blocks = gpu_memory.check_fits(self, tp.min(gpu_memory.num_kv_blocks(self)))
        self.num_blocks = num_blocks
        self.kv_cache: torch.Tensor | None = None
        self.attn: AttentionBackend | TritonAttentionBackend | None = None
        if not self.encoder:
            progress.set_phase("allocating the KV cache")
            self.allocate_kv_cache(num_blocks)
        self.sampler = Sampler(seed, watermark, self.device)
        self.sampling_batches = SamplingBatches()
        progress.set_phase("building the decode step")
        if self.device.type == "cpu" and not self.encoder:
            assert self.attn is not None  # allocated above
            self.fast_decode = FusedDecode.build(self.model, self.attn, model_config.dtype, block_size, tp)
        elif self.cuda_graphs:
            self.fast_decode = CudaGraphDecode.capture(self)
        if lora_config is not None:
            self._add_lora_slots(lora_config)

    def _add_lora_slots(self, lora_config: LoRAConfig) -> None:
        self.lora = LoRASlots(
            self.model, lora_config.max_loras, lora_config.max_lora_rank, self.config.dtype, self.device
        )
        set_lora = getattr(self.fast_decode, "set_lora", None)
        if self.fast_decode is not None and not set_lora:
            self.fast_decode = None  # a fast path without adapters (CUDA graphs): steps run op by op
            logger.info("LoRA: decode steps run op by op (this backend's fast path has no adapters)")
        elif set_lora is not None:
            set_lora(self.lora.specs())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg, tp = self.config, self.tp
        # One tensor for the whole cache: [layers, K/V, slots, kv_heads, head_dim]; one block more than
        # the pool's, never in any table, where padded rows of a CUDA-graph batch write.
        # torch.empty, no memset at start-up (seconds for GiBs): on the CPU a background thread
        # faults the pages in instead. Nothing reads a slot before it is written, except the null
        # block 0 that pads block tables, which is zeroed here.
        scaled = cfg.kv_scaled_dtype  # int8 / float8 e4m3, or None: the model's dtype
        kv_heads = cfg.num_kv_heads // tp.size
        self.scratch_slot = num_blocks * self.block_size
        shape = (cfg.num_layers, 2, (num_blocks + 1) * self.block_size, kv_heads)
        self.kv_cache = None  # the old cache goes before the new one comes (re-sizing after profiling)
        # On the CPU on transparent huge pages: a decode step reads its requests' blocks, scattered
        # over the cache, and on 4 KiB pages each one missed the TLB (1.07-1.4x slower attention).
        empty = huge_page_empty if self.device.type == "cpu" else functools.partial(torch.empty, device=self.device)
        self.kv_cache = empty((*shape, cfg.head_dim), dtype=scaled or cfg.dtype)
        self.kv_cache[:, :, : self.block_size].zero_()
        # int8 / fp8: one float32 scale per (layer, K/V, slot, kv head).
        self.kv_scales = empty(shape, dtype=torch.float32).zero_() if scaled else None
        # (benchmarks wait for it: tokenmill.bench.offline measures the steady state)
        self.kv_populate = populate_in_background(self.kv_cache) if self.device.type == "cpu" else None
        heads = cfg.hf_config.num_attention_heads // tp.size
        layers = getattr(self.model, "attention_layers", None)  # per-layer windows, soft-caps, scales
        if self.backend is AttentionBackend:
            self.attn = AttentionBackend(
                self.kv_cache,
                heads,
                kv_heads,
                cfg.head_dim,
                use_cpp_kernels=cpu_kernels.enabled(),
                kv_scales=self.kv_scales,
                layers=layers,
            )
        else:
            self.attn = self.backend(
                self.kv_cache, heads, kv_heads, cfg.head_dim, kv_scales=self.kv_scales, layers=layers
            )

    # ---- batch preparation ------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[SeqChunk] = []
        logits_rows: list[int] = []
        prompt_rows: list[tuple[int, int]] = []
        row0s: list[int] = []
        for s in sched.scheduled:
            req, n, table, k = s.request, s.num_new_tokens, s.block_ids, len(s.spec_token_ids)
            start = req.num_computed_tokens
            row0 = len(input_ids)
            row0s.append(row0)
            input_ids.extend(req.all_token_ids[start : start + n - k])
            input_ids.extend(s.spec_token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            seqs.append(SeqChunk(row0, n, start, table))
            if s.samples:  # with drafts: the last token's row and each draft's (verification)
                logits_rows.extend(range(row0 + n - 1 - k, row0 + n))
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # the last prompt position predicts the first output, not a prompt token
                prompt_rows.append((row0, row0 + min(n, req.num_prompt_tokens - 1 - start)))
        return StepInputs(
            index_tensor(input_ids),
            index_tensor(positions),
            self.backend.build_metadata(seqs, slots, bs),
            index_tensor(logits_rows),
            prompt_rows,
            self.lora.step_rows(sched.scheduled) if self.lora is not None else None,
            PoolingMetadata.build(sched.scheduled, row0s) if self.pooler is not None else None,
        )

    def to_device(self, step: StepInputs) -> StepInputs:
        """The step's index tensors on the model's device (one host-to-device copy); every rank
        gets the step as host tensors and copies it to its own GPU."""
        if self.staging is None:
            return step
        meta = step.meta
        host = {
            "input_ids": step.input_ids,
            "positions": step.positions,
            "logits_rows": step.logits_rows,
            **meta.tensors(),
        }
        dev = self.staging(host)
        for name in meta.tensors():
            setattr(meta, name, dev[name])
        lora_rows = step.lora_rows.to(self.device) if step.lora_rows is not None else None
        return StepInputs(
            dev["input_ids"], dev["positions"], meta, dev["logits_rows"], step.prompt_rows, lora_rows, step.pooling
        )

    # ---- the step ---------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> SamplerOutput | None:
        step = self.prepare(sched)
        if self.workers is not None:
            self.workers.broadcast(step)
        try:
            logits, prompt_logits = self.run(self.to_device(step))
        except Exception as e:  # a collective that failed because a worker died says so
            raise (self.workers.check(e) if self.workers is not None else e) from e
        self._score_prompt_logprobs(sched, prompt_logits)
        if step.pooling is not None:
            assert self.pooler is not None  # pooling rows come from an embed engine
            self.pooler.update(sched.scheduled, step.pooling)
        if logits is None:
            return None
        if any(s.spec_token_ids for s in sched.scheduled):
            return verify_drafts(self.sampler, logits, [s for s in sched.scheduled if s.samples])
        sampling_reqs = [s.request for s in sched.scheduled if s.samples]
        return self.sampler(logits, self.sampling_batches(sampling_reqs, logits.shape[-1], logits.device))

    @torch.inference_mode()
    def run(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The forward pass (every rank): logits of the sampled rows and of each prompt-logprobs
        range, on rank 0 (None on the others)."""
        if (
            self.fast_decode is not None
            and not step.prompt_rows
            and step.pooling is None
            and self.fast_decode.accepts(step.meta, len(step.input_ids))
        ):
            extra = {"row_slots": step.lora_rows} if step.lora_rows is not None else {}
            return self.fast_decode(step.input_ids, step.positions, step.meta, step.logits_rows, **extra), []
        if self.lora is not None:
            self.lora.row_slots = step.lora_rows  # the LoRA linears read it (lora/layers.py)
        hidden = self.model(step.input_ids, step.positions, self.attn, step.meta)
        if step.pooling is not None and self.tp.rank == 0:
            assert self.pooler is not None  # pooling rows come from an embed engine
            self.pooler(hidden, step.pooling)
        prompt_logits = [self.model.compute_logits(hidden[a:b]) for a, b in step.prompt_rows]
        logits = self.model.compute_logits(hidden[step.logits_rows]) if len(step.logits_rows) else None
        return logits, prompt_logits

    @staticmethod
    def _score_prompt_logprobs(sched: SchedulerOutput, prompt_logits: list[torch.Tensor | None]) -> None:
        """Scores the prompt tokens this step's chunks predict (position p predicts token p + 1)
        into request.prompt_logprobs, in the order prepare() listed the ranges."""
        ranges = iter(prompt_logits)
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                logits, top_n = next(ranges), req.sampling_params.prompt_logprobs
                assert logits is not None and top_n is not None  # rank 0's; set with req.prompt_logprobs
                end = start + logits.shape[0]
                targets = req.prompt_token_ids[start + 1 : end + 1]
                req.prompt_logprobs[start:end] = score_tokens(logits, targets, top_n)

    def check_health(self) -> None:
        if self.workers is not None and self.workers.dead:
            raise self.workers.check(RuntimeError())

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.stop()
        if self.device.type == "cuda":
            # Give the GPU back now (KV cache, graph pools, weights), not when the engine object is
            # collected: the next engine in this process sizes its KV cache from what is free.
            self.fast_decode = self.kv_cache = self.kv_scales = self.attn = self.model = self.lora = None
            gc.collect()
            torch.cuda.empty_cache()
