"""The engine's adapters by name: those from --lora-modules, those loaded at run time, and those a
request names offline; loaded copies kept in host memory, least recently used dropped past
--max-cpu-loras (a request holding one keeps it alive; the next request reloads it from disk).

With --lora-path-allowlist, an adapter is read only from inside the allowed folders, through its
real path (checked once, then read from there: a symlink swapped afterwards cannot redirect it).

Runs on the request-preparation threads (never the engine thread): loading reads the folder and
checks it against the base model there, so a slow disk or a bad adapter never stalls a step.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict

import torch

from tokenmill.lora.adapter import LinearShape, LoRAAdapter, LoRAError, load_adapter
from tokenmill.lora.config import LoRAConfig, path_allowed
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill")


class LoRARegistry:
    def __init__(
        self,
        config: LoRAConfig,
        shapes: dict[str, LinearShape],
        num_layers: int,
        dtype: torch.dtype,
        base_model_name: str,
    ):
        self.config = config
        self._shapes, self._num_layers, self._dtype, self._base = shapes, num_layers, dtype, base_model_name
        self._lock = threading.Lock()
        self._known: dict[str, tuple[LoRARequest, int]] = {}  # name -> (request, uid)
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._uids = itertools.count(1)
        for req in config.lora_modules:
            self.add(req)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._known)

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            entry = self._known.get(name)
        return entry[0] if entry else None

    def add(self, req: LoRARequest) -> LoRAAdapter:
        """Registers and loads an adapter (LoRAError if it cannot serve, or the name is taken)."""
        with self._lock:
            if req.lora_name in self._known:
                raise LoRAError(f"a LoRA adapter named {req.lora_name!r} is already loaded")
        adapter = self._load(req, next(self._uids))
        with self._lock:
            if req.lora_name in self._known:  # lost a race with another load of the same name
                raise LoRAError(f"a LoRA adapter named {req.lora_name!r} is already loaded")
            self._known[req.lora_name] = (req, adapter.uid)
            self._keep(adapter)
        logger.info(
            "LoRA adapter %r loaded from %s: rank %d, %d linears, %.1f MB",
            req.lora_name,
            req.lora_path,
            adapter.rank,
            len(adapter.weights),
            adapter.nbytes / 1e6,
        )
        return adapter

    def remove(self, name: str) -> bool:
        """Forgets an adapter; requests already holding it finish with it."""
        with self._lock:
            self._loaded.pop(name, None)
            return self._known.pop(name, None) is not None

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The loaded adapter for a request: by name when registered (a request's path, if any, must
        match), else registered now from the request's path (offline LoRARequest)."""
        with self._lock:
            entry = self._known.get(req.lora_name)
            if entry is not None:
                known, uid = entry
                if req.lora_path and known.lora_path and req.lora_path != known.lora_path:
                    raise LoRAError(
                        f"LoRA adapter {req.lora_name!r} is loaded from {known.lora_path!r}, not {req.lora_path!r}"
                    )
                adapter = self._loaded.get(req.lora_name)
                if adapter is not None:
                    self._loaded.move_to_end(req.lora_name)
                    return adapter
        if entry is None:
            if not req.lora_path:
                raise LoRAError(f"unknown LoRA adapter {req.lora_name!r}")
            return self.add(req)
        adapter = self._load(known, uid)  # dropped from memory: read it again (same uid: same weights)
        with self._lock:
            if req.lora_name in self._known:
                self._keep(adapter)
        return adapter

    def _load(self, req: LoRARequest, uid: int) -> LoRAAdapter:
        if not req.lora_path:
            raise LoRAError(f"LoRA adapter {req.lora_name!r} has no path")
        path = req.lora_path
        allowlist = self.config.lora_path_allowlist
        if allowlist is not None:
            path = path_allowed(path, allowlist)
            if path is None:  # one message whether or not it exists: the disk outside stays unseen
                raise LoRAError(
                    f"LoRA adapter path {req.lora_path!r} is outside the folders adapters may be "
                    f"loaded from (--lora-path-allowlist)"
                )
        return load_adapter(
            req.lora_name,
            uid,
            path,
            self._shapes,
            self._num_layers,
            self.config.max_lora_rank,
            self._dtype,
            req.base_model_name or self._base,
        )

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._loaded[adapter.name] = adapter
        self._loaded.move_to_end(adapter.name)
        while len(self._loaded) > self.config.max_cpu_loras:
            dropped, _ = self._loaded.popitem(last=False)
            logger.info("LoRA adapter %r dropped from memory (--max-cpu-loras %d)", dropped, self.config.max_cpu_loras)
