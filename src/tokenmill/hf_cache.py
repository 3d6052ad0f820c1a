"""A model folder's transformers config and tokenizer class, remembered across starts.

Loading a model's config class (AutoConfig; AutoTokenizer loads it too) makes transformers 5 import
its activations, hub-kernels and checkpoint-conversion modules, and with them torch.distributed.tensor
(sympy) and accelerate: ~1.5 s on an idle 2-core machine, the largest part of a warm `tokenmill
serve`, for a config that the engine only reads attributes of. So the first load keeps a snapshot:
the config's attributes as transformers resolved them (defaults, rope_parameters, layer_types, ...),
and the tokenizer's class as AutoTokenizer chose it; later starts rebuild the config from the
snapshot as a PretrainedConfig (whose own module is cheap) and load the tokenizer class directly.

A snapshot is written only when the rebuilt config reads back every public attribute of the
original equal (checked at write time), and is keyed by the bytes of the files transformers
decided from and by its version, so an edit or an upgrade makes a new one. Files live in
`<$TOKENMILL_CACHE_DIR or ~/.cache/tokenmill>/hf/`; a cache that cannot be written is skipped."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenmill import envs

logger = logging.getLogger("tokenmill")

SNAPSHOT_VERSION = 1  # bump when the snapshot's format or meaning changes
_UNSET = object()
# Properties that return a view of the config itself (a new object at each read, without ==): their
# content is the config's other attributes, compared one by one; here only their type is.
_VIEWS = frozenset({"per_layer_config"})


class _Unencodable(ValueError):
    pass


def _encode(v: Any) -> Any:
    """JSON for the plain values a config holds; tuples, sets, non-string dict keys and torch dtypes tagged."""
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, (set, frozenset)):
        return {"__set__": [_encode(x) for x in sorted(v, key=repr)], "frozen": isinstance(v, frozenset)}
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in v):
            return {k: _encode(x) for k, x in v.items()}
        return {"__items__": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    raise _Unencodable(type(v).__name__)


def _decode(v: Any) -> Any:
    import torch

    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tuple__" in v:
        return tuple(_decode(x) for x in v["__tuple__"])
    if "__set__" in v:
        return (frozenset if v["frozen"] else set)(_decode(x) for x in v["__set__"])
    if "__items__" in v:
        return {_decode(k): _decode(x) for k, x in v["__items__"]}
    if "__dtype__" in v:
        return getattr(torch, v["__dtype__"])
    return {k: _decode(x) for k, x in v.items()}


def _root() -> Path:
    return Path(envs.TOKENMILL_CACHE_DIR) / "hf"


def _key(kind: str, *parts: bytes | str) -> str:
    import transformers

    h = hashlib.sha256(f"{kind}\0{SNAPSHOT_VERSION}\0{transformers.__version__}".encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return f"{kind}-{h.hexdigest()[:32]}"


def _read(key: str) -> dict | None:
    try:
        return json.loads((_root() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def _write(key: str, value: dict) -> None:
    root = _root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=root)
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.chmod(tmp, 0o644)  # a cache may be shared, as the GGUF one
        os.replace(tmp, root / f"{key}.json")  # atomic: readers see no file or a whole one
    except OSError as e:
        logger.debug("could not write %s to %s: %s", key, root, e)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


# ---- config ---------------------------------------------------------------------------------------
def load_config(path: str):
    """AutoConfig.from_pretrained(path), from the snapshot of an earlier start when there is one."""
    key = _key("config", Path(path, "config.json").read_bytes())
    snap = _read(key)
    if snap is not None:
        return _rebuild(snap, path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    snap = _snapshot(config)
    if snap is not None:
        _write(key, snap)
    return config


def _attributes(config) -> dict[str, Any]:
    """What a config holds: its instance attributes and the plain class attributes of its own
    class (model_type, attribute_map, ...; PretrainedConfig's come with the rebuilt object)."""
    from transformers import PretrainedConfig

    out: dict[str, Any] = {}
    for klass in reversed(type(config).__mro__):
        if issubclass(PretrainedConfig, klass):  # PretrainedConfig and its bases
            continue
        for name, value in vars(klass).items():
            if (
                not name.startswith("__")
                and not callable(value)
                and not isinstance(value, (property, classmethod, staticmethod))
            ):
                out[name] = value
    out.update(vars(config))
    return out


def _snapshot(config) -> dict | None:
    """The snapshot of `config`, or None when the rebuilt config would not read back equal."""
    try:
        attributes = {k: _encode(v) for k, v in _attributes(config).items() if k not in ("_name_or_path",)}
    except _Unencodable as e:
        logger.debug("config of %s: a %s attribute, not snapshotted", type(config).__name__, e)
        return None
    snap = {"class": type(config).__name__, "attributes": attributes}
    rebuilt = _rebuild(json.loads(json.dumps(snap)), getattr(config, "_name_or_path", ""))
    different = _differences(config, rebuilt)
    if different:
        logger.debug("config of %s: %s read back differently, not snapshotted", type(config).__name__, different)
        return None
    return snap


def _rebuild(snap: dict, path: str):
    from transformers import PretrainedConfig

    config = PretrainedConfig.__new__(PretrainedConfig)  # no __init__: the values are transformers' already
    config.__dict__.update({k: _decode(v) for k, v in snap["attributes"].items()})
    config.__dict__["_name_or_path"] = path
    return config


def _differences(a, b) -> list[str]:
    """Public attributes (properties included) that read differently on a and b."""
    names = {n for n in dir(a) if not n.startswith("_")} | {n for n in dir(b) if not n.startswith("_")}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # deprecated properties (torch_dtype, ...) warn when read
    try:
        out = []
        for name in sorted(names):
            va, vb = _read_attr(a, name), _read_attr(b, name)
            if callable(va) and callable(vb):
                continue
            if type(va) is not type(vb) or (name not in _VIEWS and not _equal(va, vb)):
                out.append(name)
        return out
    finally:
        quiet.setLevel(level)


def _read_attr(obj, name: str) -> Any:
    try:
        return getattr(obj, name)
    except Exception:  # noqa: BLE001 - a property that raises reads as unset on both sides alike
        return _UNSET


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return a is b


# ---- tokenizer ------------------------------------------------------------------------------------
def load_tokenizer(path: str):
    """AutoTokenizer.from_pretrained(path); from an earlier start's choice of class when there is one
    (AutoTokenizer decides from tokenizer_config.json, config.json, tokenizer.json and the path)."""
    parts: list[bytes | str] = [os.path.abspath(path)]
    for name in ("tokenizer_config.json", "config.json", "tokenizer.json"):
        with contextlib.suppress(OSError):
            parts += [name, Path(path, name).read_bytes()]
    key = _key("tokenizer", *parts)
    snap = _read(key)
    if snap is not None:
        import importlib

        cls = getattr(importlib.import_module(snap["module"]), snap["name"], None)
        if cls is not None:
            return cls.from_pretrained(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cls = type(tok)
    # transformers' own classes only: a class from a model's own code (auto_map) is not imported by name
    if cls.__module__.startswith("transformers.") and "." not in cls.__qualname__:
        _write(key, {"module": cls.__module__, "name": cls.__qualname__})
    return tok
