"""CUDA graphs for decode steps: captured at start-up for bucketed batch sizes, replayed with padded inputs.

A decode step launches a few hundred small kernels; replaying a captured graph launches them all
at once, which is most of batch-1 speed on a GPU. Each bucket's graph reads the step from static
buffers (token ids, positions, slots, sequence lengths, block tables at the model's full width, so
one graph serves every context length) and writes float32 logits into one static output. A batch
of n requests runs the smallest bucket >= n; rows n.. are padding: sequence length 0 (attention
reads nothing), K/V written to the runner's scratch slot, logits ignored.

`graphs=False` runs the same padded buckets eagerly: how the padding is tested on a CPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from tokenmill.model.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from tokenmill.worker.runner import ModelRunner

logger = logging.getLogger("tokenmill")


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 (vLLM's), up to max_num_seqs (included)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class CudaGraphDecode:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, graphs: bool = True) -> None:
        self.model, self.attn, self.graphs = runner.model, runner.attn, graphs
        self.buckets = bucket_sizes(max_num_seqs)
        n, dev = self.buckets[-1], runner.device
        self.max_blocks = -(-runner.config.max_model_len // runner.block_size)
        self.scratch_slot = runner.scratch_slot
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.long, device=dev)
        self.logits = torch.zeros(n, runner.config.vocab_size, dtype=torch.float32, device=dev)
        self.block_size = runner.block_size
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: ModelRunner, max_num_seqs: int | None = None) -> CudaGraphDecode:
        self = cls(runner, max_num_seqs or runner.scheduler_config.max_num_seqs)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info()[0]
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory pool
            self._run(b)  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._run(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (1..%d) in %.1fs, %.0f MiB (--enforce-eager turns them off)",
            len(self.buckets),
            self.buckets[-1],
            time.perf_counter() - t0,
            (free0 - torch.cuda.mem_get_info()[0]) / 2**20,
        )
        return self

    def _run(self, b: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            block_size=self.block_size,
            all_decode=True,
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
        )
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.attn, meta)
        self.logits[:b].copy_(self.model.compute_logits(hidden))

    def accepts(self, meta: AttentionMetadata, rows: int) -> bool:
        return (
            meta.all_decode
            and rows <= self.buckets[-1]
            and meta.block_tables is not None
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """Float32 logits of `logits_rows`, the step's K/V written, as the model's forward would."""
        assert meta.seq_lens is not None and meta.block_tables is not None  # the varlen view (accepts)
        n = input_ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(self.scratch_slot)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].zero_()
        # Columns past a request's own blocks keep stale ids: attention never reads past seq_lens.
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.graphs:
            self._graphs[b].replay()
        else:
            self._run(b)
        return self.logits[logits_rows]
