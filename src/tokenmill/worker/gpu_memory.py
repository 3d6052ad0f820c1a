"""KV cache sizing on a GPU: --gpu-memory-utilization, as vLLM means it.

The engine may use `utilization x total` bytes of the GPU. After the weights are loaded, one
profiling step of the largest batch the scheduler can make (max_num_batched_tokens prompt tokens,
logits and sampling over max_num_seqs rows) measures the peak activation memory, and one decode
step of max_num_seqs rows the memory CUDA graphs will keep; what is left after everything already
on the GPU (weights, the CUDA context, other processes) and those two goes to KV blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tokenmill.model.layers.attention import SeqChunk
from tokenmill.worker.staging import StepInputs

if TYPE_CHECKING:
    from tokenmill.worker.runner import ModelRunner

logger = logging.getLogger("tokenmill")
GiB = 2**30


def _profile_step(runner: ModelRunner, lengths: list[int], sample_rows: int) -> int:
    """Peak bytes allocated above the current ones by one prompt step of these lengths (a temporary
    cache of just enough blocks included, then freed)."""
    bs = runner.block_size
    blocks = sum(-(-n // bs) for n in lengths) + 1
    runner.allocate_kv_cache(blocks)
    seqs: list[SeqChunk] = []
    slots: list[int] = []
    row, next_block = 0, 1
    for n in lengths:
        nb = -(-n // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        seqs.append(SeqChunk(row, n, 0, table))
        slots.extend(table[p // bs] * bs + p % bs for p in range(n))
        row += n
    total = sum(lengths)
    assert runner.attn is not None  # allocated above
    rows = torch.arange(total - sample_rows, total, dtype=torch.long)
    step = runner.to_device(
        StepInputs(
            torch.zeros(total, dtype=torch.long),
            torch.tensor([p for n in lengths for p in range(n)], dtype=torch.long),
            runner.attn.build_metadata(seqs, slots, bs),
            rows,
            [],
        )
    )
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits, _ = runner.run(step)
    if logits is not None:  # rank 0 samples; the sampler's largest temporaries: softmax and a full sort
        torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    del logits
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    runner.kv_cache = runner.kv_scales = runner.attn = None
    torch.cuda.empty_cache()
    return peak


def num_kv_blocks(runner: ModelRunner) -> int:
    sched, dev = runner.scheduler_config, runner.device_config
    util = dev.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise ValueError(f"--gpu-memory-utilization {util} must be in (0, 1]")
    max_len = runner.config.max_model_len
    tokens = sched.max_num_batched_tokens
    lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated()
    activations = _profile_step(runner, lengths, min(sched.max_num_seqs, tokens))
    graphs = 0
    if runner.cuda_graphs:  # graphs keep their own pool: about one decode step of the largest bucket
        graphs = _profile_step(runner, [1] * sched.max_num_seqs, sched.max_num_seqs)
        graphs += sched.max_num_seqs * runner.config.vocab_size * 4  # their static logits
    free, total = torch.cuda.mem_get_info()
    in_use = total - free - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    budget = util * total - in_use - activations - graphs
    block_bytes = runner.config.kv_bytes_per_token() * runner.block_size // runner.tp.size
    num_blocks = int(budget // block_bytes)
    logger.info(
        "GPU memory: %.1f GiB x %.2f; in use %.2f GiB (weights %.2f), peak activations %.2f GiB, "
        "CUDA graphs %.2f GiB; KV cache %.2f GiB = %d blocks",
        total / GiB,
        util,
        in_use / GiB,
        weights / GiB,
        activations / GiB,
        graphs / GiB,
        max(num_blocks, 0) * block_bytes / GiB,
        max(num_blocks - 1, 0),
    )
    return num_blocks


def check_fits(runner: ModelRunner, num_blocks: int) -> int:
    """num_blocks, if they hold one request of max_model_len tokens (else no request could run)."""
    max_len = runner.config.max_model_len
    need = -(-max_len // runner.block_size) + 1
    if num_blocks < need:
        raise ValueError(
            f"--gpu-memory-utilization {runner.device_config.gpu_memory_utilization} leaves room for "
            f"{max(num_blocks - 1, 0)} KV blocks, fewer than one request at max_model_len {max_len} needs "
            f"({need - 1}); raise --gpu-memory-utilization, or lower --max-model-len, --max-num-seqs or "
            f"--max-num-batched-tokens"
        )
    return num_blocks
