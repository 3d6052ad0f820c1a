"""tokenmill/envs.py declares every environment variable tokenmill reads: no module reads a
TOKENMILL_* variable itself, docs/environment-variables.md documents each, and values are read
when asked (a variable set at run time is seen)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokenmill import envs

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "tokenmill"


def _env_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each read of a TOKENMILL_* variable from os.environ / os.getenv, by a string
    literal or a module constant holding one."""
    consts = {
        t.id: node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def name_of(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("TOKENMILL_") else None

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (
                f.attr == "getenv" or (f.attr in ("get", "pop", "setdefault") and is_environ(f.value))
            ):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and name_of(key):
            found.append((node.lineno, name_of(key)))
    return found


def test_no_module_reads_a_tokenmill_variable_itself():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in sorted(SRC.rglob("*.py"))
        if path != SRC / "envs.py"
        for line, name in _env_reads(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not offenders, "read TOKENMILL_* variables through tokenmill.envs:\n" + "\n".join(offenders)


def test_the_check_sees_direct_reads():
    code = (
        'import os\nKEY = "TOKENMILL_X"\nos.environ.get("TOKENMILL_A")\nos.getenv("TOKENMILL_B")\n'
        'os.environ["TOKENMILL_C"]\nos.environ.get(KEY, "")\n"TOKENMILL_D" in os.environ\n'
        'os.environ.get("HOME")\n'
    )
    assert [name for _, name in _env_reads(ast.parse(code))] == [
        "TOKENMILL_A",
        "TOKENMILL_B",
        "TOKENMILL_C",
        "TOKENMILL_X",
        "TOKENMILL_D",
    ]


def test_every_tokenmill_variable_named_in_the_code_is_declared():
    """A TOKENMILL_* name anywhere in the package (docstrings, messages) is one envs.py declares."""
    named = {
        m
        for path in SRC.rglob("*.py")
        for m in re.findall(r"\bTOKENMILL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8"))
    }
    named |= set(re.findall(r"\bTOKENMILL_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / "setup.py").read_text(encoding="utf-8")))
    assert named <= set(envs.ENVIRONMENT_VARIABLES), sorted(named - set(envs.ENVIRONMENT_VARIABLES))


def test_envs_imports_nothing_from_tokenmill():
    tree = ast.parse((SRC / "envs.py").read_text(encoding="utf-8"))
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] == "tokenmill"], imported


def test_the_docs_page_lists_every_variable_as_envs_declares_it():
    page = (ROOT / "docs" / "environment-variables.md").read_text(encoding="utf-8")
    assert envs.markdown_table() in page, "regenerate the table: python -m tokenmill.envs"
    for name in envs.ENVIRONMENT_VARIABLES:
        assert f"`{name}`" in page, name
    assert "environment-variables.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_values_are_read_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    assert envs.TOKENMILL_CACHE_DIR == str(Path.home() / ".cache" / "tokenmill")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert envs.TOKENMILL_CACHE_DIR == str(tmp_path)
    for raw, on in ((None, True), ("1", True), ("0", False), ("no", True)):
        if raw is None:
            monkeypatch.delenv("TOKENMILL_BATCH_INVARIANT", raising=False)
        else:
            monkeypatch.setenv("TOKENMILL_BATCH_INVARIANT", raw)
        assert envs.TOKENMILL_BATCH_INVARIANT is on, raw
    monkeypatch.setenv("TOKENMILL_NO_CPP_KERNELS", "true")  # only exactly 1 turns it on, as before
    assert envs.TOKENMILL_NO_CPP_KERNELS is False
    monkeypatch.setenv("TOKENMILL_KERNEL_LEVELS", " avx2, amx ,")
    assert envs.TOKENMILL_KERNEL_LEVELS == ["avx2", "amx"]
    monkeypatch.setenv("TOKENMILL_API_KEY", "")
    assert envs.TOKENMILL_API_KEY is None
    with pytest.raises(AttributeError):
        envs.TOKENMILL_NOT_A_VARIABLE  # noqa: B018


def test_overriding_a_variable(monkeypatch):
    monkeypatch.delenv("TOKENMILL_BATCH_INVARIANT", raising=False)
    envs.override("TOKENMILL_BATCH_INVARIANT", "0")
    assert envs.TOKENMILL_BATCH_INVARIANT is False
    envs.override("TOKENMILL_BATCH_INVARIANT", None)
    assert envs.TOKENMILL_BATCH_INVARIANT is True
    with pytest.raises(KeyError):
        envs.override("TOKENMILL_TYPO", "1")
