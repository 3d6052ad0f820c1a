"""The tests' layout: test modules in tests/<package>/ folders, only conftest.py and the shared helpers
in tests/ itself, and every marker the tests use registered in pyproject.toml (run with --strict-markers)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# tests/ itself: conftest.py and the helpers the test modules import by name (pyproject's pythonpath = ["tests"])
ROOT_FILES = {
    "conftest.py",
    "tiny_models.py",
    "hf_oracle.py",
    "gguf_writer.py",
    "lora_adapters.py",
    "embedding_data.py",
    "sampler_scenario.py",
    "sampler_golden.json",
}
# markers the tokenmill tests apply (pyproject.toml's [tool.pytest.ini_options] markers)
OWN_MARKERS = {"slow", "gpu", "browser", "ray"}


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_no_test_module_in_the_tests_root():
    loose = sorted(p.name for p in TESTS.iterdir() if p.is_file() and p.name not in ROOT_FILES)
    assert not loose, f"in tests/ itself (a test module goes into its package's folder, tests/<package>/): {loose}"
    for helper in ROOT_FILES:
        assert (TESTS / helper).is_file(), f"tests/{helper} is gone: update ROOT_FILES"


def test_test_modules_sit_one_folder_down_with_unique_names():
    modules = _test_modules()
    assert len(modules) > 50
    deep = [str(p.relative_to(TESTS)) for p in modules if len(p.relative_to(TESTS).parts) != 2]
    assert not deep, f"test modules go exactly one folder under tests/: {deep}"
    # no __init__.py: pytest imports each module by its basename, so two of one name would collide
    twice = [name for name, n in Counter(p.name for p in modules).items() if n > 1]
    assert not twice, f"test module names used twice: {twice}"
    assert not list(TESTS.rglob("__init__.py")), "tests/ folders are not packages (rootdir-relative basenames)"


def test_markers_are_registered_and_strict(pytestconfig):
    registered = {line.split(":")[0].split("(")[0].strip() for line in pytestconfig.getini("markers")}
    assert OWN_MARKERS <= registered, OWN_MARKERS - registered
    assert getattr(pytestconfig.option, "strict_markers", False) or "--strict-markers" in pytestconfig.getini("addopts")
    # the sources too: a module skipped at import (importorskip) never shows its marks to --strict-markers
    used: dict[str, set[str]] = {}
    for path in [*_test_modules(), TESTS / "conftest.py"]:
        for name in re.findall(r"\bpytest\.mark\.([A-Za-z_]\w*)", path.read_text()):
            used.setdefault(name, set()).add(str(path.relative_to(TESTS)))
    unknown = {name: sorted(where) for name, where in used.items() if name not in registered}
    assert not unknown, f"markers not registered in pyproject.toml: {unknown}"
    assert OWN_MARKERS <= set(used), f"registered, never used: {OWN_MARKERS - set(used)}"
