"""The packages import in one direction only: each layer may import the layers below it, never one
above (docs/architecture.md draws the picture). An import under `if TYPE_CHECKING:` is an
annotation, not a dependency, and is not counted. An import of tokenmill inside a function is
allowed only with a `# lazy:` comment saying why it waits (start-up time, an optional dependency)."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "tokenmill"

# Top to bottom. A module may import its own package and anything in a later row; never an earlier
# row, nor another package of its own row.
LAYERS: list[set[str]] = [
    {"cli"},
    {"bench", "ray_serve"},
    {"server"},
    {"llm"},
    {"beam_search"},
    {"engine"},
    {"spec_decode"},
    {"worker"},
    {"lora", "sample"},
    {"model"},
    {"distributed"},
    {"kernels"},
    {"tokenizer", "kv_cache", "step"},
    {"hf_cache", "request", "outputs"},
    {"config", "progress"},
    {"sampling_params", "pooling_params"},
    {"envs"},
]
RANK = {name: i for i, row in enumerate(LAYERS) for name in row}


def _unit(module: str) -> str:
    """The layer unit of a dotted module name under tokenmill: its package, or the root module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path):
    """(line, imported module, inside a function, under TYPE_CHECKING, has a `# lazy:` comment)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node, in_function: bool, type_checking: bool):
        for child in ast.iter_child_nodes(node):
            func = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            tc = type_checking or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                names = [f"{target}.{a.name}" for a in child.names] if target == "tokenmill" else [target]
            elif isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            else:
                names = []
            for name in names:
                if name.startswith("tokenmill."):
                    lazy = any(
                        "# lazy:" in line for line in lines[max(child.lineno - 2, 0) : child.lineno]
                    )  # or the line above
                    yield child.lineno, name, in_function, tc, lazy
            yield from visit(child, func, tc)

    yield from visit(tree, False, False)


def _all_imports():
    for path in sorted(SRC.rglob("*.py")):
        if path.parent == SRC and path.stem in ("__init__", "__main__"):
            continue  # the package's public face and `python -m tokenmill`: above every layer
        module = _module_name(path)
        unit = _unit(module) if path.parent != SRC else module.split(".")[1]
        for line, target, in_function, type_checking, lazy in _imports(path):
            target_unit = target.split(".")[1]
            yield path.relative_to(SRC), line, unit, target_unit, in_function, type_checking, lazy


def test_every_unit_has_a_layer():
    units = {p.stem if p.parent == SRC else p.relative_to(SRC).parts[0] for p in SRC.rglob("*.py")}
    units.discard("__init__")
    units.discard("__main__")
    assert units - RANK.keys() == set(), "add the new package or module to LAYERS"


def test_imports_point_down():
    upward = []
    for path, line, unit, target, _, type_checking, _ in _all_imports():
        if type_checking or unit == target or target not in RANK:
            continue
        if RANK[target] <= RANK[unit]:
            upward.append(f"{path}:{line}: {unit} imports {target}")
    assert upward == []


def test_no_unexplained_imports_inside_functions():
    hidden = [
        f"{path}:{line}: {unit} -> {target}"
        for path, line, unit, target, in_function, _, lazy in _all_imports()
        if in_function and not lazy
    ]
    assert hidden == [], "import at the top of the module, or say why it waits with `# lazy: <reason>`"


@pytest.mark.parametrize("source", ["from tokenmill.worker.runner import ModelRunner\n"])
def test_an_upward_import_is_caught(tmp_path, source, monkeypatch):
    """The check itself fails on an import that points up (a model module importing the worker)."""
    fake = tmp_path / "tokenmill" / "model"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "tokenmill")
    with pytest.raises(AssertionError, match="model imports worker"):
        test_imports_point_down()
