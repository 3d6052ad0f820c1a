"""What a long start-up is doing: the phase `/health` reports while `tokenmill serve` loads its
engine (server/startup.py), and progress over the long loops of a load (weights, GGUF
conversion): tqdm's bar when stderr is a terminal, else a log line every LOG_INTERVAL_S, so
that a log file or `kubectl logs` shows a slow load moving. A leaf module: the loaders report
here, the server reads here, neither knows the other.

One phase per process: a process loads one engine at a time (several engines loading at
once, as tests may, report whichever moved last)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

logger = logging.getLogger("tokenmill")

LOG_INTERVAL_S = 10.0  # without a terminal: a progress line at most this often (a load shorter says nothing)
T = TypeVar("T")


@dataclass(frozen=True)
class Phase:
    name: str  # e.g. "loading weights"
    done: int | None = None  # items of a tracked loop done so far
    total: int | None = None
    unit: str | None = None


_phase: Phase | None = None  # replaced whole, never mutated: readers on other threads see one or the other


def set_phase(name: str) -> None:
    global _phase
    _phase = Phase(name)
    logger.debug("start-up: %s", name)


def current() -> dict | None:
    """The phase as /health shows it: {"phase": ..., and "done", "total", "unit" in a tracked loop}."""
    phase = _phase
    if phase is None:
        return None
    return {("phase" if k == "name" else k): v for k, v in asdict(phase).items() if v is not None}


def track(items: Sequence[T], desc: str, unit: str, leave: bool = False) -> Iterator[T]:
    """Yields `items`, reporting progress as the phase `desc` (lower-cased), on a tqdm bar when
    stderr is a terminal, else in a log line every LOG_INTERVAL_S."""
    global _phase
    from tqdm import tqdm

    name, total = desc[:1].lower() + desc[1:], len(items)
    _phase = Phase(name, 0, total, unit)
    bar = tqdm(total=total, desc=desc, unit=unit, leave=leave, disable=None)  # None: a terminal only
    last = time.monotonic()
    try:
        for i, item in enumerate(items, 1):
            yield item
            _phase = Phase(name, i, total, unit)
            bar.update(1)
            if bar.disable and time.monotonic() - last >= LOG_INTERVAL_S and i < total:
                last = time.monotonic()
                logger.info("%s: %d/%d %ss (%.0f%%)", desc, i, total, unit, 100 * i / total)
    finally:
        bar.close()
