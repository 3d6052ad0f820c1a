"""LoRAConfig: vLLM's LoRA engine arguments, parsed and checked at start-up."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tokenmill.lora.request import LoRARequest


@dataclass
class LoRAConfig:
    max_loras: int = 1  # adapters one step may hold (slots beside the base weights)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory, LRU; default max(max_loras, modules)
    lora_modules: list[LoRARequest] = field(default_factory=list)  # served from start-up
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # Folders adapters may be read from (their subfolders too); None: anywhere. Kept as real paths.
    lora_path_allowlist: list[str] | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, len(self.lora_modules))
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        if self.lora_path_allowlist is not None:
            roots = []
            for root in self.lora_path_allowlist:
                if not os.path.isdir(root):  # a typo would otherwise refuse every adapter without saying why
                    raise ValueError(f"--lora-path-allowlist {root!r} is not a folder")
                roots.append(os.path.realpath(root))
            self.lora_path_allowlist = roots
        names = [m.lora_name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names the same adapter twice: {names}")


def path_allowed(path: str, allowlist: list[str]) -> str | None:
    """`path`'s real path (symlinks resolved: a link inside cannot lead out) when it lies in one
    of the allowlist's real folders, else None."""
    real = os.path.realpath(path)
    for root in allowlist:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return real
    return None


def parse_lora_modules(specs: list[str | dict] | None) -> list[LoRARequest]:
    """vLLM's --lora-modules forms: `name=path`, or JSON `{"name", "path", "base_model_name"}`
    (dicts as they are); ids are given in order from 1."""
    out = []
    for i, spec in enumerate(specs or [], start=1):
        if isinstance(spec, str) and spec.lstrip().startswith("{"):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {spec!r}: not valid JSON ({e})") from None
        if isinstance(spec, dict):
            unknown = set(spec) - {"name", "path", "base_model_name"}
            if unknown or "name" not in spec or "path" not in spec:
                raise ValueError(
                    f'--lora-modules {json.dumps(spec)}: give "name" and "path" '
                    f'(and optionally "base_model_name"); unknown: {sorted(unknown)}'
                )
            out.append(LoRARequest(spec["name"], i, spec["path"], spec.get("base_model_name")))
        else:
            name, sep, path = str(spec).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: use name=path or a JSON object")
            out.append(LoRARequest(name, i, path))
    return out
