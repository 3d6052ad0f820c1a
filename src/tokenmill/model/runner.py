"""ModelRunner: owns the model and the KV cache tensor; runs one flat batch per step."""

from __future__ import annotations

import logging

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.layers import cpu_kernels
from tokenmill.model.layers.attention import AttentionBackend, AttentionMetadata, PrefillChunk
from tokenmill.model.layers.sampler import Sampler, SamplerOutput, SamplingBatch, score_tokens
from tokenmill.model.loader import load_model
from tokenmill.watermark import WatermarkConfig

logger = logging.getLogger("tokenmill")


class ModelRunner:
    def __init__(self, model_config: ModelConfig, num_blocks: int, block_size: int, seed: int = 0,
                 watermark: WatermarkConfig | None = None):
        self.config = model_config
        self.block_size = block_size
        self.device = model_config.device
        self.model = load_model(
            model_config.path, model_config.hf_config, model_config.dtype, model_config.max_model_len, self.device,
            model_config.quantization,
        )
        cfg = model_config
        # One tensor for the whole cache: [layers, K/V, slots, kv_heads, head_dim].
        # torch.empty: pages are touched on first use instead of a multi-second memset at start-up.
        # Nothing reads a slot before it is written, except the null block 0 that pads block
        # tables, which is zeroed here.
        quantized = cfg.kv_cache_dtype == "int8"
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads)
        self.kv_cache = torch.empty(*shape, cfg.head_dim, dtype=torch.int8 if quantized else cfg.dtype,
                                    device=self.device)
        self.kv_cache[:, :, :block_size].zero_()
        # int8: one float32 scale per (layer, K/V, slot, kv head).
        self.kv_scales = torch.zeros(*shape, dtype=torch.float32, device=self.device) if quantized else None
        self.attn = AttentionBackend(
            self.kv_cache, cfg.hf_config.num_attention_heads, cfg.num_kv_heads, cfg.head_dim,
            use_cpp_kernels=cpu_kernels.enabled(), kv_scales=self.kv_scales,
        )
        self.sampler = Sampler(seed, watermark)
        self.fused_decode = FusedDecode.build(self.model, self.attn, cfg.dtype, block_size)

    # ---- batch preparation ------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        logits_rows: list[int] = []
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

        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), block_size=bs)
        if decode_rows:
            max_blocks = -(-max(decode_lens) // bs)
            padded = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in decode_tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long)
            meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long)
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long)
        meta.prefills = prefills
        meta.all_decode = not prefills
        return (
            torch.tensor(input_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            meta,
            logits_rows,
        )

    # ---- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> SamplerOutput | None:
        input_ids, positions, meta, logits_rows = self.prepare(sched)
        if (self.fused_decode is not None and self.fused_decode.accepts(meta, len(input_ids))
                and not _wants_prompt_logprobs(sched)):
            logits = self.fused_decode(input_ids, positions, meta, logits_rows)
        else:
            hidden = self.model(input_ids, positions, self.attn, meta)
            self._prompt_logprobs(sched, hidden)
            logits = self.model.compute_logits(hidden[logits_rows]) if logits_rows else None
        if not logits_rows:
            return None
        sampling_reqs = [s.request for s in sched.scheduled if s.samples]
        batch = SamplingBatch.from_requests(sampling_reqs, logits.shape[-1])
        return self.sampler(logits, batch)

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor) -> None:
        """For requests that want prompt logprobs: score the prompt tokens this step's chunk
        predicts (position p predicts token p + 1) into request.prompt_logprobs."""
        row = 0
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            start, P = req.num_computed_tokens, req.num_prompt_tokens
            if req.prompt_logprobs is not None and start < P - 1:
                end = min(start + n, P - 1)  # the last prompt position predicts the first output
                logits = self.model.compute_logits(hidden[row : row + end - start])
                targets = req.prompt_token_ids[start + 1 : end + 1]
                req.prompt_logprobs[start:end] = score_tokens(logits, targets, req.sampling_params.prompt_logprobs)
            row += n


def _wants_prompt_logprobs(sched: SchedulerOutput) -> bool:
    """Whether a request of this step still has prompt tokens to score (needs hidden states)."""
    return any(s.request.prompt_logprobs is not None and s.request.num_computed_tokens < s.request.num_prompt_tokens - 1
               for s in sched.scheduled)


def _slots_for(table: list[int], length: int, bs: int) -> torch.Tensor:
    pos = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
