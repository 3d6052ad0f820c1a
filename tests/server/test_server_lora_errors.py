"""What POST /v1/load_lora_adapter answers for adapters that cannot serve: malformed configs are 400s
naming the field (never a 500 quoting the file), a config over the size bound is refused unread,
--lora-path-allowlist refuses paths elsewhere with one message whether or not they exist, an
unexpected failure is a generic 500; and /openapi.json documents the routes' errors as JSON.
A real uvicorn server over the tiny random Llama with runtime LoRA loading on."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import running_server
from lora_adapters import make_adapter

pytest.importorskip("peft")

from tokenmill.engine.arg_utils import add_engine_args, engine_args_from  # noqa: E402
from tokenmill.lora.adapter import MAX_CONFIG_BYTES  # noqa: E402
from tokenmill.lora.config import LoRAConfig  # noqa: E402

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
SECRET = "SECRET-LINE "


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """`allowed`: the allowlisted folder, holding a good adapter; `outside`: a folder beside it,
    holding a copy of that adapter."""
    root = tmp_path_factory.mktemp("lora-errors")
    allowed, outside = root / "allowed", root / "outside"
    good = make_adapter(tiny_llama_dir, allowed / "good", rank=8, seed=21)
    shutil.copytree(good, outside / "good")
    return {"allowed": allowed, "outside": outside, "good": Path(good)}


@pytest.fixture(scope="module")
def http(tiny_llama_dir, folders):
    with running_server(
        tiny_llama_dir,
        enable_lora=True,
        allow_runtime_lora_updating=True,
        max_lora_rank=16,
        lora_path_allowlist=[str(folders["allowed"])],
    ) as (server, _):
        with httpx.Client(base_url=server.url, timeout=60) as h:
            yield h


def _variant(folders, name: str, config: dict | None = None, raw: bytes | None = None) -> str:
    """A copy of the good adapter in the allowed folder, its config updated by `config` or replaced by `raw`."""
    path = folders["allowed"] / name
    shutil.copytree(folders["good"], path)
    cfg_path = path / "adapter_config.json"
    if config is not None:
        cfg = json.loads(cfg_path.read_text())
        cfg.update(config)
        cfg_path.write_text(json.dumps(cfg))
    if raw is not None:
        cfg_path.write_bytes(raw)
    return str(path)


def _load(http, name: str, path: str) -> httpx.Response:
    return http.post(LOAD, json={"lora_name": name, "lora_path": path})


def _refused(r: httpx.Response, *words: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["param"] == "lora_path"
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err["message"]


def test_non_utf8_config_is_a_400_that_does_not_quote_the_file(http, folders):
    raw = b'{"peft_type": "LORA", "note": "\xff' + SECRET.encode() * 20_000 + b'"}'  # ~240 KB
    r = _load(http, "latin1", _variant(folders, "latin1", raw=raw))
    _refused(r, "UTF-8")
    assert SECRET not in r.text and len(r.content) < 2_000


@pytest.mark.parametrize(
    "name,config,words",
    [
        ("alpha-string", {"lora_alpha": "16"}, ["lora_alpha", "'16'"]),
        ("alpha-null", {"lora_alpha": None}, ["lora_alpha", "None"]),
        ("alpha-nan", {"lora_alpha": float("nan")}, ["lora_alpha"]),
        ("pattern-value", {"alpha_pattern": {"q_proj": "x"}}, ["alpha_pattern", "q_proj"]),
        ("pattern-regex", {"alpha_pattern": {"q_proj(": 4}}, ["alpha_pattern", "regular expression"]),
        ("pattern-list", {"alpha_pattern": ["q_proj"]}, ["alpha_pattern"]),
        ("modules-to-save-long", {"modules_to_save": [SECRET * 1000]}, ["modules_to_save"]),
    ],
)
def test_malformed_config_is_a_400_naming_the_field(http, folders, name, config, words):
    r = _load(http, name, _variant(folders, name, config=config))
    _refused(r, *words)
    assert len(r.content) < 2_000  # values are quoted shortened


def test_deeply_nested_config_is_a_400(http, folders):
    depth = 200_000
    raw = b'{"peft_type": "LORA", "x": ' + b"[" * depth + b"]" * depth + b"}"
    _refused(_load(http, "nested", _variant(folders, "nested", raw=raw)), "nested too deeply")


def test_rank_0_weights_are_a_400(http, folders):
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(_variant(folders, "rank0"))
    weights = load_file(str(path / "adapter_model.safetensors"))
    zero = {k: torch.zeros((0, t.shape[1]) if "lora_A" in k else (t.shape[0], 0)) for k, t in weights.items()}
    save_file(zero, str(path / "adapter_model.safetensors"))
    _refused(_load(http, "rank0", str(path)), "rank 0")


def test_config_over_the_bound_is_refused_before_it_is_read(http, folders):
    path = _variant(folders, "huge")
    with open(os.path.join(path, "adapter_config.json"), "r+b") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)  # sparse zeros: read, they would be a JSON error
    _refused(_load(http, "huge", path), "larger than", f"{MAX_CONFIG_BYTES:,} bytes")


def test_paths_outside_the_allowlist_are_refused_alike(http, folders):
    """An adapter that exists outside, a path that does not, a way out through `..`, a symlink inside
    that points outside: the same message, but for the path it quotes."""
    link = folders["allowed"] / "link-out"
    link.symlink_to(folders["outside"] / "good", target_is_directory=True)
    paths = [
        str(folders["outside"] / "good"),
        str(folders["outside"] / "nothing-here"),
        str(folders["allowed"] / ".." / "outside" / "good"),
        str(link),
        "/etc",
    ]
    messages = {
        _refused(_load(http, f"out{i}", p), "--lora-path-allowlist").replace(repr(p), "PATH")
        for i, p in enumerate(paths)
    }
    assert len(messages) == 1, messages
    assert "exist" not in messages.pop()
    assert http.post(LOAD, json={"lora_name": "inside", "lora_path": str(folders["good"])}).status_code == 200
    assert http.post(UNLOAD, json={"lora_name": "inside"}).status_code == 200


def test_unexpected_load_failure_is_a_generic_500(http, folders, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError(SECRET)

    monkeypatch.setattr("tokenmill.lora.registry.load_adapter", boom)
    r = _load(http, "boom", str(folders["good"]))
    assert r.status_code == 500 and SECRET not in r.text
    assert "request id" in r.json()["error"]["message"]


def test_openapi_documents_the_lora_errors_as_json(http):
    paths = http.get("/openapi.json").json()["paths"]
    for path in (LOAD, UNLOAD):
        responses = paths[path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"text/plain"}
        assert {"400", "401", "404", "413", "500"} <= set(responses), (path, sorted(responses))
        for status, resp in responses.items():
            if status != "200":
                assert set(resp["content"]) == {"application/json"}, (path, status)
    r = http.post(UNLOAD, json={})  # the 400 the schema now states
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_allowlist_flag(tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--lora-path-allowlist", str(tmp_path), "/srv/a", "--lora-path-allowlist", "/srv/b"])
    assert engine_args_from(ns).lora_path_allowlist == [str(tmp_path), "/srv/a", "/srv/b"]
    assert engine_args_from(p.parse_args([])).lora_path_allowlist is None
    with pytest.raises(ValueError, match="--lora-path-allowlist"):
        LoRAConfig(lora_path_allowlist=[str(tmp_path / "typo")])
    link = tmp_path / "link"
    link.symlink_to(tmp_path, target_is_directory=True)
    assert LoRAConfig(lora_path_allowlist=[str(link)]).lora_path_allowlist == [os.path.realpath(tmp_path)]
