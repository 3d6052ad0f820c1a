"""Pooling: a request's embedding from the final hidden states of its prompt (vLLM's pooling models).

`PoolerConfig` says how: the last token's state (LAST), the mean over the prompt (MEAN) or the
first token's (CLS), L2-normalised or not. It comes from the sentence-transformers folder layout
when the model has one (modules.json: its Pooling module's config, a Normalize module), else the
family's default (encoders CLS, decoders LAST; normalised, as vLLM's), then --override-pooler-config.

`Pooler` runs inside the model runner's step: each pooling request in the step contributes the rows
of its prompt chunk (the token's state for LAST / CLS, the rows' sum for MEAN), computed for all of
them at once; the runner hands the contributions to `update`, which keeps them on the request
across chunks (a decoder's long prompt may take several steps; a preempted request starts over
from its first chunk) and, at the prompt's last chunk, finishes the embedding (mean, Matryoshka
truncation, normalisation) into `request.pooled_data`, a float32 CPU tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (new `pooling_mode` names and legacy pooling_mode_* keys).
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_LEGACY = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # modules.json types we run (the class name)


@dataclass
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True
    # Matryoshka models (`dimensions` allowed): config.json's matryoshka_dimensions (only those) or is_matryoshka.
    matryoshka_dimensions: list[int] | None = None
    is_matryoshka: bool = False
    source: str = "default"  # where the pooling type came from (logged)

    def __post_init__(self) -> None:
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type {self.pooling_type!r} is not supported; choose one of {', '.join(POOLING_TYPES)}"
            )

    def check_dimensions(self, dimensions: int | None, model_name: str, hidden_size: int) -> None:
        """vLLM's rules (and words) for a request's `dimensions`."""
        if dimensions is None:
            return
        if not (self.is_matryoshka or self.matryoshka_dimensions):
            raise ValueError(
                f'Model "{model_name}" does not support matryoshka representation, changing output '
                f"dimensions will lead to poor results."
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f'Model "{model_name}" only supports {self.matryoshka_dimensions} matryoshka dimensions, '
                f"use other output dimensions will lead to poor results."
            )
        if dimensions > hidden_size:
            raise ValueError(f"dimensions must be at most the model's embedding size {hidden_size}, got {dimensions}")


def pooler_config_for(path: str, hf_config, is_encoder: bool, override: str | dict | None = None) -> PoolerConfig:
    """The pooler of a model folder: sentence-transformers layout, else the family default; then
    `override` (vLLM's --override-pooler-config JSON: {"pooling_type": "MEAN", "normalize": true})."""
    st = _sentence_transformers_pooling(path)
    if st is not None:
        cfg = PoolerConfig(*st, source="sentence-transformers modules.json")
    else:
        cfg = PoolerConfig("CLS" if is_encoder else "LAST", True)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    cfg.matryoshka_dimensions = sorted(int(d) for d in dims) if dims else None
    cfg.is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False))
    if override:
        extra = json.loads(override) if isinstance(override, str) else dict(override)
        unknown = set(extra) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"--override-pooler-config: unknown keys {sorted(unknown)} (pooling_type, normalize)")
        if "pooling_type" in extra:
            cfg.pooling_type, cfg.source = str(extra["pooling_type"]).upper(), "--override-pooler-config"
        if "normalize" in extra:
            cfg.normalize = bool(extra["normalize"])
        cfg.__post_init__()
    return cfg


def _sentence_transformers_pooling(path: str) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers folder; None without modules.json.
    Refuses modules we do not run (Dense, ...): their vectors would silently differ."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.exists(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unsupported = [k for k in kinds if k not in _ST_MODULES]
    if unsupported:
        raise ValueError(
            f"{modules_file}: sentence-transformers modules {unsupported} are not supported "
            f"(supported: {', '.join(_ST_MODULES)})"
        )
    if "Pooling" not in kinds:
        return None
    with open(os.path.join(path, kinds["Pooling"].get("path", ""), "config.json")) as f:
        pooling = json.load(f)
    mode = pooling.get("pooling_mode")
    if mode is None:  # the legacy boolean keys; none set means mean, as sentence-transformers reads them
        mode = [name for key, name in _ST_LEGACY.items() if pooling.get(key)] or ["mean"]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"sentence-transformers pooling mode {mode!r} is not supported (supported: {', '.join(_ST_MODES)})"
        )
    if pooling.get("include_prompt") is False:
        raise ValueError("sentence-transformers pooling with include_prompt false is not supported")
    return _ST_MODES[modes[0]], "Normalize" in kinds


TASKS = ("auto", "generate", "embed")


def resolve_task(
    task: str, model_cls: type, path: str, hf_config, override_pooler_config: str | dict | None = None
) -> PoolerConfig | None:
    """The pooler of an engine that runs embeddings (`--task embed`, or auto for an encoder), None for
    one that generates; one task per engine, as vLLM serves one per server."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    arch, encoder = hf_config.architectures[0], getattr(model_cls, "IS_ENCODER", False)
    if task == "auto":
        task = "embed" if encoder else "generate"
    if task == "generate":
        if encoder:
            raise ValueError(f"{arch} is an encoder: it computes embeddings only (--task embed), it cannot generate")
        if override_pooler_config:
            raise ValueError("--override-pooler-config applies to --task embed only")
        return None
    if not hasattr(model_cls, "final_hidden"):
        raise ValueError(f"--task embed is not supported for {arch} yet")
    return pooler_config_for(path, hf_config, encoder, override_pooler_config)


def sentence_transformers_max_len(path: str) -> int | None:
    """sentence_bert_config.json's max_seq_length: the length sentence-transformers truncates to,
    which vLLM takes as the model's max_model_len (inputs over it are refused, not truncated)."""
    try:
        with open(os.path.join(path, "sentence_bert_config.json")) as f:
            return json.load(f).get("max_seq_length")
    except (OSError, ValueError):
        return None


@dataclass
class PoolingMetadata:
    """One step's pooling requests, in step order: each one's rows [row0, row0 + n) of the flat
    batch and whether they start its prompt. Travels with the step to tensor-parallel workers."""

    row0: list[int]
    num_rows: list[int]
    first: list[bool]
    parts: torch.Tensor | None = field(default=None, repr=False)  # [P, hidden] float32, set by Pooler (rank 0)

    @classmethod
    def build(cls, scheduled, row0s: list[int]) -> PoolingMetadata | None:
        rows = [(s, r) for s, r in zip(scheduled, row0s) if s.request.pooling_params is not None]
        if not rows:
            return None
        return cls(
            [r for _, r in rows],
            [s.num_new_tokens for s, _ in rows],
            [s.request.num_computed_tokens == 0 for s, _ in rows],
        )


class Pooler:
    def __init__(self, config: PoolerConfig, final_hidden: Callable[[torch.Tensor], torch.Tensor]):
        self.config = config
        self.final_hidden = final_hidden  # the model's last step before pooling (a decoder's final norm)

    def __call__(self, hidden: torch.Tensor, meta: PoolingMetadata) -> None:
        """Each request's contribution from this step's rows, into meta.parts."""
        kind, device = self.config.pooling_type, hidden.device
        if kind == "MEAN":
            counts = torch.tensor(meta.num_rows)
            if sum(meta.num_rows) == hidden.shape[0]:  # every row pools (an encoder's step): no gather
                states = hidden
            else:
                idx = torch.cat([torch.arange(r, r + n) for r, n in zip(meta.row0, meta.num_rows)])
                states = hidden[idx.to(device)]
            seg = torch.repeat_interleave(torch.arange(len(meta.row0)), counts).to(device)
            sums = torch.zeros(len(meta.row0), hidden.shape[1], dtype=torch.float32, device=device)
            meta.parts = sums.index_add_(0, seg, self.final_hidden(states).float())
            return
        rows = meta.row0 if kind == "CLS" else [r + n - 1 for r, n in zip(meta.row0, meta.num_rows)]
        meta.parts = self.final_hidden(hidden[torch.tensor(rows, device=device)]).float()

    def update(self, scheduled, meta: PoolingMetadata) -> None:
        """Onto each pooling request: its contribution so far, and at its prompt's end the embedding."""
        kind = self.config.pooling_type
        reqs = [s for s in scheduled if s.request.pooling_params is not None]
        done = []
        for i, (s, first) in enumerate(zip(reqs, meta.first)):
            req, part = s.request, meta.parts[i]
            if first or kind == "LAST":
                req.pooled_data = part
            elif kind == "MEAN":
                req.pooled_data = req.pooled_data + part
            if req.num_computed_tokens + s.num_new_tokens == req.num_prompt_tokens:
                done.append(req)
        if done:
            self._finish(done)

    def _finish(self, reqs: list) -> None:
        vecs = torch.stack([r.pooled_data for r in reqs])
        if self.config.pooling_type == "MEAN":
            vecs /= torch.tensor([r.num_prompt_tokens for r in reqs], dtype=torch.float32, device=vecs.device)[:, None]
        vecs = vecs.cpu()
        settings = [
            (
                r.pooling_params.dimensions or vecs.shape[1],
                self.config.normalize if r.pooling_params.normalize is None else r.pooling_params.normalize,
            )
            for r in reqs
        ]
        if len(set(settings)) == 1:  # the usual case: one op for the whole step
            ((dims, norm),) = set(settings)
            out = F.normalize(vecs[:, :dims], dim=-1) if norm else vecs[:, :dims]
            rows = out.unbind(0)
        else:
            rows = [F.normalize(v[:d], dim=-1) if norm else v[:d] for v, (d, norm) in zip(vecs, settings)]
        for r, v in zip(reqs, rows):
            r.pooled_data = v
