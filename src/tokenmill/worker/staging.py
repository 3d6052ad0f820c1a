"""A step's flat batch (StepInputs), its index tensors built on the host (attention.index_tensor) and, on a GPU,
moved to the device in one non_blocking copy from pinned host memory (PinnedStaging).

Two pinned buffers take turns; before a buffer is filled again its last copy must have left it
(an event per buffer), since a step that samples nothing never syncs with the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.pooling import PoolingMetadata


@dataclass
class StepInputs:
    """One step's flat batch: everything every rank needs to run it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [R] rows whose next token is sampled
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)  # row ranges scored for prompt logprobs
    lora_rows: torch.Tensor | None = None  # [T] int32 each row's LoRA slot (-1: base model); None: no adapters
    pooling: PoolingMetadata | None = None  # the pooling requests' rows (embeddings; model/pooling.py)


class PinnedStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.buffers = [self._alloc(capacity) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    @staticmethod
    def _alloc(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.long, pin_memory=True)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """int64 host tensors -> the same names on the device (views of one copied buffer)."""
        total = sum(t.numel() for t in tensors.values())
        i, self.turn = self.turn, 1 - self.turn
        last = self.events[i]
        if last is not None:
            last.synchronize()
        if total > self.buffers[i].numel():
            self.buffers[i] = self._alloc(max(total, 2 * self.buffers[i].numel()))
        host = self.buffers[i][:total]
        torch.cat([t.reshape(-1).to(torch.long) for t in tensors.values()], out=host)
        flat = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stubs leave Event.__new__ untyped
        event.record()
        self.events[i] = event
        out, at = {}, 0
        for name, t in tensors.items():
            out[name] = flat[at : at + t.numel()].view(t.shape)
            at += t.numel()
        return out
