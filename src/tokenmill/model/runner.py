"""ModelRunner: owns the model and the KV cache tensor; runs one flat batch per step.

Under tensor parallelism every rank has a ModelRunner over its shard (and its kv heads' share
of the cache): rank 0's prepares each step and sends it to the workers (`workers`), then all
ranks `run` it; only rank 0 gets logits and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenmill.config import ModelConfig
from tokenmill.distributed.comm import NO_TP, TPGroup
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.layers import cpu_kernels
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from tokenmill.model.layers.sampler import Sampler, SamplerOutput, SamplingBatch, score_tokens
from tokenmill.model.loader import load_model
from tokenmill.watermark import WatermarkConfig

logger = logging.getLogger("tokenmill")


@dataclass
class StepInputs:
    """One step's flat batch: everything every rank needs to run it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: list[int]  # rows whose next token is sampled
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # row ranges scored for prompt logprobs


class ModelRunner:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int, seed: int = 0,
                 watermark: WatermarkConfig | None = None, tp: TPGroup = NO_TP, workers=None):
        self.config = model_config
        self.block_size = block_size
        self.device = model_config.device
        self.tp, self.workers = tp, workers  # workers: rank 0's TPWorkers (distributed/executor.py)
        self.model = load_model(
            model_config.path, model_config.hf_config, model_config.dtype, model_config.max_model_len, self.device,
            model_config.quantization, tp,
        )
        cfg = model_config
        # One tensor for the whole cache: [layers, K/V, slots, kv_heads, head_dim].
        # torch.empty: pages are touched on first use instead of a multi-second memset at start-up.
        # Nothing reads a slot before it is written, except the null block 0 that pads block
        # tables, which is zeroed here.
        quantized = cfg.kv_cache_dtype == "int8"
        kv_heads = cfg.num_kv_heads // tp.size
        shape = (cfg.num_layers, 2, num_blocks * block_size, kv_heads)
        self.kv_cache = torch.empty(*shape, cfg.head_dim, dtype=torch.int8 if quantized else cfg.dtype,
                                    device=self.device)
        self.kv_cache[:, :, :block_size].zero_()
        # int8: one float32 scale per (layer, K/V, slot, kv head).
        self.kv_scales = torch.zeros(*shape, dtype=torch.float32, device=self.device) if quantized else None
        self.attn = AttentionBackend(
            self.kv_cache, cfg.hf_config.num_attention_heads // tp.size, kv_heads, cfg.head_dim,
            use_cpp_kernels=cpu_kernels.enabled(), kv_scales=self.kv_scales,
        )
        self.sampler = Sampler(seed, watermark)
        self.fused_decode = FusedDecode.build(self.model, self.attn, cfg.dtype, block_size, tp)

    # ---- batch preparation ------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        logits_rows: list[int] = []
        prompt_rows: list[tuple[int, int]] = []
        for s in sched.scheduled:
            req, n, table = s.request, s.num_new_tokens, s.block_ids
            start = req.num_computed_tokens
            row0 = len(input_ids)
            input_ids.extend(req.all_token_ids[start : start + n])
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if n == 1:
                decode_rows.append(row0)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                kv_slots = None
                if start > 0:
                    kv_slots = _slots_for(table, start + n, bs)
                chunk_table = torch.tensor(table[: -(-(start + n) // bs)], dtype=torch.long)
                prefills.append(PrefillChunk(row0, row0 + n, start, kv_slots, chunk_table))
            if s.samples:
                logits_rows.append(row0 + n - 1)
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # the last prompt position predicts the first output, not a prompt token
                prompt_rows.append((row0, row0 + min(n, req.num_prompt_tokens - 1 - start)))

        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=bs)
        if decode_rows:
            max_blocks = -(-max(decode_lens) // bs)
            padded = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long)
            meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long)
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        meta.prefills = prefills
        meta.all_decode = not prefills
        return StepInputs(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          meta, logits_rows, prompt_rows)

    # ---- the step ---------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> SamplerOutput | None:
        step = self.prepare(sched)
        if self.workers is not None:
            self.workers.broadcast(step)
        try:
            logits, prompt_logits = self.run(step)
        except Exception as e:  # a collective that failed because a worker died says so
            raise (self.workers.check(e) if self.workers is not None else e) from e
        self._score_prompt_logprobs(sched, prompt_logits)
        if not step.logits_rows:
            return None
        sampling_reqs = [s.request for s in sched.scheduled if s.samples]
        batch = SamplingBatch.from_requests(sampling_reqs, logits.shape[-1])
        return self.sampler(logits, batch)

    @torch.inference_mode()
    def run(self, step: StepInputs) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """The forward pass (every rank): logits of the sampled rows and of each prompt-logprobs
        range, on rank 0 (None on the others)."""
        if (self.fused_decode is not None and not step.prompt_rows
                and self.fused_decode.accepts(step.meta, len(step.input_ids))):
            return self.fused_decode(step.input_ids, step.positions, step.meta, step.logits_rows), []
        hidden = self.model(step.input_ids, step.positions, self.attn, step.meta)
        prompt_logits = [self.model.compute_logits(hidden[a:b]) for a, b in step.prompt_rows]
        logits = self.model.compute_logits(hidden[step.logits_rows]) if step.logits_rows else None
        return logits, prompt_logits

    @staticmethod
    def _score_prompt_logprobs(sched: SchedulerOutput, prompt_logits: list[torch.Tensor]) -> None:
        """Scores the prompt tokens this step's chunks predict (position p predicts token p + 1)
        into request.prompt_logprobs, in the order prepare() listed the ranges."""
        ranges = iter(prompt_logits)
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                logits = next(ranges)
                end = start + logits.shape[0]
                targets = req.prompt_token_ids[start + 1 : end + 1]
                req.prompt_logprobs[start:end] = score_tokens(logits, targets, req.sampling_params.prompt_logprobs)

    def check_health(self) -> None:
        if self.workers is not None and self.workers.dead:
            raise self.workers.check(RuntimeError())

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.stop()


def _slots_for(table: list[int], length: int, bs: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
