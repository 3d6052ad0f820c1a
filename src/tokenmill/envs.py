"""Every environment variable tokenmill reads, in one table (as vLLM's envs.py): its name, its
default, how its text is read, and what it does. Modules read them only through here:

    from tokenmill import envs
    if envs.TOKENMILL_NO_CPP_KERNELS: ...

Each access reads the environment again (nothing is cached), so a variable set at run time (a
test's monkeypatch, a parent process preparing a child's environment) is seen by the next read.

This module imports nothing from tokenmill: setup.py and the kernels' build (kernels/isa.py,
loaded by path before the package is importable) read it too. docs/environment-variables.md
lists the same table (tests/test_envs.py checks that the two agree).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger("tokenmill.envs")


class EnvVar(NamedTuple):
    default: str  # the default as the documentation states it
    parse: Callable[[str | None], Any]  # the variable's text (None: unset) -> its value
    doc: str  # what it does (one paragraph)
    when: str = "run"  # run | build: read while tokenmill runs, or while its package is built


def _is_1(raw: str | None) -> bool:
    """On only when set to exactly 1."""
    return raw == "1"


def _not_0(raw: str | None) -> bool:
    """On unless set to exactly 0."""
    return raw != "0"


def _text(raw: str | None) -> str | None:
    """The text, or None when unset or empty."""
    return raw or None


def _true(raw: str | None) -> bool:
    """1 or true (any case), as vLLM reads its switches."""
    return (raw or "").strip().lower() in ("1", "true")


def _cache_dir(raw: str | None) -> str:
    return raw or str(Path.home() / ".cache" / "tokenmill")


def _spin_us(raw: str | None) -> float:
    default = 100.0
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        logger.warning("TOKENMILL_SPIN_US=%r is not a number; using %g", raw, default)
        return default


def _panel_weights(raw: str | None) -> str | None:
    """ "1" (forced on), "0" (forced off), or None (anything else: automatic)."""
    return raw if raw in ("0", "1") else None


def _levels(raw: str | None) -> list[str]:
    return [s.strip() for s in (raw or "").split(",") if s.strip()]


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    # ---- the server
    "TOKENMILL_API_KEY": EnvVar(
        "unset",
        _text,
        "The default of `tokenmill serve --api-key`: every route but /health and the API docs then needs "
        "`Authorization: Bearer <key>` (or `x-api-key: <key>`). Unset or empty: no authentication.",
    ),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        "unset",
        _true,
        "vLLM's switch, honoured as the default of `--allow-runtime-lora-updating`: `1` or `true` serves "
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with `--enable-lora`).",
    ),
    # ---- files
    "TOKENMILL_CACHE_DIR": EnvVar(
        "~/.cache/tokenmill",
        _cache_dir,
        "Where tokenmill caches what it derives from models and the machine: converted GGUF checkpoints "
        "(`gguf/`), W8A8 calibration statistics (`w8a8/`), snapshots of model folders' transformers configs and tokenizer classes (`hf/`) and C++ "
        "kernels compiled on first use (`kernels/`).",
    ),
    # ---- CPU kernels
    "TOKENMILL_CPU_ISA": EnvVar(
        "the CPU's highest level",
        lambda raw: (raw or "").strip().lower(),
        "Cap the ISA level of the C++ CPU kernels loaded (e.g. `avx2` on an AVX-512 machine, to compute "
        "as an AVX2-only machine does). A level above the CPU's own is an error.",
    ),
    "TOKENMILL_NO_CPP_KERNELS": EnvVar(
        "0", _is_1, "`1`: never load or compile the C++ CPU kernels; every operation runs its pure-torch code."
    ),
    "TOKENMILL_BATCH_INVARIANT": EnvVar(
        "1",
        _not_0,
        "`0`: bf16 models loaded from then on may compute a row differently depending on the rest of its "
        "batch (oneDNN for prompt steps, the prefill attention kernel, decode attention split over threads): "
        "faster prompts where oneDNN has AMX. Default: batch-invariant results.",
    ),
    "TOKENMILL_PANEL_WEIGHTS": EnvVar(
        "unset (automatic)",
        _panel_weights,
        "`1` forces, `0` forbids, the extra panel-packed copy of bf16 linear weights used for small batches "
        "(by default kept for models up to about 1 GiB of such weights).",
    ),
    "TOKENMILL_QUANT_PANELS": EnvVar(
        "1", _not_0, "`0` keeps int4 / int8 weight-only quantized linears in rows instead of the C++ kernels' panels."
    ),
    "TOKENMILL_NO_PACKED_LINEAR": EnvVar(
        "0", _is_1, "`1`: on the CPU, leave linear layers as torch's (no oneDNN / panel packing at load time)."
    ),
    "TOKENMILL_FUSED_DECODE": EnvVar(
        "1", _not_0, "`0` turns off the fused CPU decode step (one C++ call for a whole decode step of small models)."
    ),
    "TOKENMILL_SPIN_US": EnvVar(
        "100",
        _spin_us,
        "Microseconds the fused step's thread barriers spin before they sleep; a step then slows in "
        "proportion, rather than collapsing, when other processes share the cores. Not a number: the default.",
    ),
    "TOKENMILL_W8A8_LM_HEAD": EnvVar(
        "1", _not_0, "`0` keeps the LM head in the model's dtype under `--quantization w8a8` (default: int8 too)."
    ),
    # ---- attention and tensor parallelism
    "TOKENMILL_ATTENTION_BACKEND": EnvVar(
        "cpu on the CPU, triton on a GPU",
        _text,
        "`cpu` (the C++ kernels) or `triton`; `triton` on the CPU runs the Triton kernels under "
        "TRITON_INTERPRET=1 (tests).",
    ),
    "TOKENMILL_TP_ALLREDUCE": EnvVar(
        "shm",
        lambda raw: raw if raw is not None else "shm",
        "How tensor-parallel CPU ranks all-reduce: `shm` (shared memory) or `gloo` (torch.distributed's).",
    ),
    "TOKENMILL_TP_POLL_US": EnvVar(
        "2000",
        lambda raw: float(raw if raw is not None else "2000"),
        "Microseconds a tensor-parallel worker polls for the next step after one ends before it blocks "
        "(read once, when the workers start).",
    ),
    # ---- building the package (setup.py)
    "TOKENMILL_KERNEL_LEVELS": EnvVar(
        "every level",
        _levels,
        "Comma-separated ISA levels (e.g. `avx2,amx`) whose C++ kernels a package build compiles; a machine "
        "whose level is missing compiles it on first use.",
        "build",
    ),
    "TOKENMILL_SKIP_KERNEL_BUILD": EnvVar(
        "0", _is_1, "`1`: a package build compiles no C++ kernels (they compile on first use).", "build"
    ),
}


def value(name: str) -> Any:
    """The variable's value now (read from the environment at each call)."""
    return ENVIRONMENT_VARIABLES[name].parse(os.environ.get(name))


def override(name: str, text: str | None) -> None:
    """Set a variable for this process and its children from now on (None: unset it)."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(name)
    if text is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = text


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return value(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *ENVIRONMENT_VARIABLES])


def markdown_table() -> str:
    """The table of docs/environment-variables.md."""
    rows = ["| Variable | Default | When | What it does |", "|---|---|---|---|"]
    for name, var in ENVIRONMENT_VARIABLES.items():
        rows.append(f"| `{name}` | {var.default} | {var.when} | {var.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m tokenmill.envs: the table of docs/environment-variables.md
    print(markdown_table(), end="")
