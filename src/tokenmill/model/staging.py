"""A step's index tensors: built on the host from lists of ints (index_tensor), and on a GPU
moved to the device in one non_blocking copy from pinned host memory (PinnedStaging).

Two pinned buffers take turns; before a buffer is filled again its last copy must have left it
(an event per buffer), since a step that samples nothing never syncs with the device.
"""

from __future__ import annotations

from array import array

import torch


def index_tensor(values: list[int], *shape: int) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long), viewed as `shape` when given (rows, columns), at a
    third of its cost: the tensor takes an array's buffer as its memory, with no per-element type
    inference. A step builds several of these right after a forward that has evicted the caches,
    where torch.tensor's ~15 us each add up to a few percent of a batch-1 decode step."""
    if not values:
        return torch.empty(shape or (0,), dtype=torch.long)
    t = torch.frombuffer(array("q", values), dtype=torch.long)
    return t.view(shape) if shape else t


class PinnedStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 16):
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
        if self.events[i] is not None:
            self.events[i].synchronize()
        if total > self.buffers[i].numel():
            self.buffers[i] = self._alloc(max(total, 2 * self.buffers[i].numel()))
        host = self.buffers[i][:total]
        torch.cat([t.reshape(-1).to(torch.long) for t in tensors.values()], out=host)
        flat = host.to(self.device, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        out, at = {}, 0
        for name, t in tensors.items():
            out[name] = flat[at : at + t.numel()].view(t.shape)
            at += t.numel()
        return out
