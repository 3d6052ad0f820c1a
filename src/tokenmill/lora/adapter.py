"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and
laid out for the engine's fused linears.

PEFT adapts a linear y = W x into y = W x + scaling * B (A x), with A [r, in], B [out, r] and
scaling lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Our q/k/v and gate/up projections
are fused (one linear each), so an adapter's q_proj, k_proj and v_proj become three *slices* of
qkv_proj's adapter (gate_proj, up_proj: two of gate_up_proj's), each with its own A and B; the
scaling is folded into B, kept transposed (Bt [r, out]) as the kernel reads it (csrc/lora.h).
Where the checkpoint itself is fused (Phi-3's qkv_proj, gate_up_proj), PEFT adapts the fused
module whole: each slice then gets the one A and its rows of B.

Refused at load, with a message naming the problem (the server answers 400): modules_to_save,
embedding or LM-head adapters, DoRA, LoRA biases, ranks above --max-lora-rank, tensors whose
shapes do not fit the base model (an adapter trained for another model), a config that is not
UTF-8 JSON, larger than MAX_CONFIG_BYTES or nested too deeply, a lora_alpha or alpha_pattern that
is not what PEFT writes, rank-0 weights. Messages quote a config's values only shortened: the
folder may not be the client's own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("tokenmill")

# Our fused linears and the PEFT module names that are their slices, in slice order.
LINEARS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_SLICE_OF = {peft: (ours, i) for ours, parts in LINEARS.items() for i, peft in enumerate(parts)}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served with this base model (the server answers 400)."""


@dataclass(frozen=True)
class LinearShape:
    """One fused linear of the base model: its input size and its slices' output sizes."""

    in_features: int
    slices: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slices)

    @property
    def bounds(self) -> list[int]:
        b = [0]
        for s in self.slices:
            b.append(b[-1] + s)
        return b


def linear_shapes(model) -> dict[str, LinearShape]:
    """The shapes of each layer's four adaptable linears (every layer alike in these families)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.cfg.hidden_size
    return {
        "qkv_proj": LinearShape(hidden, (attn.q_size, attn.kv_size, attn.kv_size)),
        "o_proj": LinearShape(attn.q_size, (hidden,)),
        "gate_up_proj": LinearShape(hidden, (mlp.intermediate, mlp.intermediate)),
        "down_proj": LinearShape(mlp.intermediate, (hidden,)),
    }


@dataclass
class LoRAAdapter:
    """A loaded adapter: per (layer, fused linear), its slices' (slice index, A [r, in], Bt [r, out_slice])
    in the model's dtype, scaling folded into Bt. `uid` is unique per load (it keys the prefix cache,
    so an adapter reloaded under the same name never reuses the old one's K/V)."""

    name: str
    uid: int
    path: str
    rank: int
    weights: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values() for _, a, b in parts)


# PEFT writes a config of a few KB (target_modules, alpha_pattern and rank_pattern grow it with the
# model's depth); anything near this is not an adapter config, and is refused before it is read.
MAX_CONFIG_BYTES = 1 << 20
_SHORT = reprlib.Repr()  # Python 3.11's takes no arguments
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 2, 60, 60, 4, 4


def _short(value: object) -> str:
    """A config value as a message quotes it: bounded in length and depth."""
    return _SHORT.repr(value)


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter folder {path!r} does not exist")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"{path!r} is not a PEFT adapter folder: no adapter_config.json")
    too_large = f"{cfg_path}: larger than the {MAX_CONFIG_BYTES:,} bytes an adapter config may have"
    try:
        with open(cfg_path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_CONFIG_BYTES:
                raise LoRAError(too_large)
            raw = f.read(MAX_CONFIG_BYTES + 1)  # bounded even if the file grows after the check
    except OSError as e:
        raise LoRAError(f"{cfg_path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise LoRAError(too_large)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # its str() is safe; its repr() holds the whole file
        raise LoRAError(f"{cfg_path}: not UTF-8 text (byte {e.start} is invalid)") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise LoRAError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise LoRAError(f"{cfg_path}: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path}: not a JSON object")
    return cfg


def _finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_config(cfg: dict, path: str) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if not isinstance(peft_type, str) or peft_type.upper() != "LORA":
        raise LoRAError(f"{path}: peft_type {_short(peft_type)} is not LoRA")
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"{path}: modules_to_save ({_short(cfg['modules_to_save'])}) is not supported: the adapter "
            f"replaces whole modules, which cannot be batched with other adapters"
        )
    if cfg.get("use_dora"):
        raise LoRAError(f"{path}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise LoRAError(f"{path}: LoRA biases (bias={_short(cfg['bias'])}) are not supported")
    # PEFT's defaults apply when a key is absent; a key that is there must be what PEFT writes.
    if "lora_alpha" in cfg and not _finite_number(cfg["lora_alpha"]):
        raise LoRAError(f"{path}: lora_alpha must be a finite number, got {_short(cfg['lora_alpha'])}")
    patterns = cfg.get("alpha_pattern")
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise LoRAError(
            f"{path}: alpha_pattern must be an object of module-name patterns to numbers, got {_short(patterns)}"
        )
    for pattern, value in patterns.items():
        try:
            re.compile(_alpha_regex(pattern))
        except (re.error, RecursionError, OverflowError):
            raise LoRAError(f"{path}: alpha_pattern key {_short(pattern)} is not a valid regular expression") from None
        if not _finite_number(value):
            raise LoRAError(f"{path}: alpha_pattern[{_short(pattern)}] must be a finite number, got {_short(value)}")


def _alpha_regex(pattern: str) -> str:
    """PEFT's match of an alpha_pattern key: the module name ends with it, after a dot."""
    return rf"(.*\.)?({pattern})$"


def _scaling(module: str, rank: int, cfg: dict) -> float:
    """PEFT's scaling for one module: its alpha (alpha_pattern, else lora_alpha) over r (or sqrt r)."""
    alpha = cfg.get("lora_alpha", 8)
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(_alpha_regex(pattern), module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise LoRAError(f"{st}: cannot be read ({e})") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise LoRAError(f"{pt}: cannot be read ({e})") from None
    raise LoRAError(f"{path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(
    name: str,
    uid: int,
    path: str,
    shapes: dict[str, LinearShape],
    num_layers: int,
    max_rank: int,
    dtype: torch.dtype,
    base_model_name: str | None = None,
) -> LoRAAdapter:
    """Reads and checks an adapter folder for a base model of these linear shapes; LoRAError if it cannot serve."""
    cfg = read_adapter_config(path)
    _check_config(cfg, path)
    declared = cfg.get("base_model_name_or_path")
    if (
        base_model_name
        and declared
        and os.path.basename(str(declared).rstrip("/")) != os.path.basename(base_model_name.rstrip("/"))
    ):
        logger.warning(
            "LoRA adapter %r was trained on %r; serving it on %r (its shapes fit)", name, declared, base_model_name
        )
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            what = (
                "an embedding adapter"
                if "lora_embedding" in key or "embed_tokens" in key
                else "an LM-head adapter"
                if "lm_head" in key
                else "a tensor this engine cannot apply"
            )
            raise LoRAError(
                f"{path}: {key!r} is {what}: only q/k/v/o_proj and gate/up/down_proj adapters are supported"
            )
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in _SLICE_OF and module not in LINEARS:
            raise LoRAError(f"{path}: {key!r}: module {module!r} is not one of {sorted(_SLICE_OF)}")
        if layer >= num_layers:
            raise LoRAError(f"{path}: {key!r}: layer {layer}, but the base model has {num_layers} layers")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise LoRAError(f"{path}: the adapter has no LoRA weights")
    weights: dict[tuple[int, str], list] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{path}: layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        ours, i = _SLICE_OF.get(module, (module, None))  # None: a fused module adapted whole, every slice
        shape = shapes[ours]
        out = shape.out_features if i is None else shape.slices[i]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape.in_features or b.shape != (out, a.shape[0]):
            raise LoRAError(
                f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"model ({module} is {shape.in_features} -> {out}): an adapter for another base model?"
            )
        r = a.shape[0]
        if r == 0:  # PEFT never writes one; its scaling would divide by zero
            raise LoRAError(f"{path}: layer {layer} {module}: rank 0 (lora_A has no rows)")
        if r > max_rank:
            raise LoRAError(f"{path}: rank {r} ({module}) is above --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scale = _scaling(f"model.layers.{layer}.{module}", r, cfg)
        bt = (b.float() * scale).t().contiguous()
        if i is None:
            bounds = shape.bounds
            for j in range(len(shape.slices)):
                part = bt[:, bounds[j] : bounds[j + 1]].contiguous()
                weights.setdefault((layer, ours), []).append((j, a.to(dtype).contiguous(), part.to(dtype)))
        else:
            weights.setdefault((layer, ours), []).append((i, a.to(dtype).contiguous(), bt.to(dtype)))
    return LoRAAdapter(name, uid, path, rank, weights)
