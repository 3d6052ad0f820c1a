"""MkDocs hook: the CLI reference page (reference/cli.md), generated at build time from the argument parser.

Every subcommand of `tokenmill.cli.build_parser()` (nested ones too: `bench serve`, `watermark detect`) gets a
section with its usage line and one table per argument group: flag, default, help. Nothing here names an
option, so an option added to the parser shows up on the next build.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mkdocs.structure.files import File

PAGE = "reference/cli.md"
REPO = Path(__file__).resolve().parents[2]


def _build_parser() -> argparse.ArgumentParser:
    try:
        from tokenmill.cli import build_parser
    except ImportError:  # a checkout that is not installed: the sources beside this file
        sys.path.insert(0, str(REPO / "src"))
        from tokenmill.cli import build_parser
    return build_parser()


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    text = _cell(text)
    tick = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{tick}{pad}{text}{pad}{tick}"


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(_code(s) for s in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (action.dest.upper() if not action.choices else None)
            if action.choices and not action.metavar:
                metavar = "{" + ",".join(map(str, action.choices)) + "}"
            names += f" {_code(metavar)}" if metavar else ""
        return names
    return _code(action.metavar or action.dest)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
        return ""
    return _code(repr(action.default) if isinstance(action.default, str) and not action.default else action.default)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    try:
        text = parser._get_formatter()._expand_help(action)
    except (KeyError, TypeError, ValueError):
        text = action.help
    return _cell(text)


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name, "")))
    return out


def _section(path: list[str], parser: argparse.ArgumentParser, summary: str, lines: list[str]) -> None:
    subs = _subparsers(parser)
    depth = min(len(path), 4)
    lines += [f"{'#' * (depth + 1)} `{' '.join(path)}`", ""]
    if summary or parser.description:
        lines += [_cell(parser.description or summary), ""]
    usage = " ".join(parser.format_usage().replace("usage:", "", 1).split())
    lines += ["```text", usage, "```", ""]
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))
        ]
        if not actions:
            continue
        title = (group.title or "options").strip()
        lines += [f"**{title[0].upper() + title[1:]}**", ""]
        if group.description:
            lines += [_cell(group.description), ""]
        lines += ["| flag | default | help |", "|---|---|---|"]
        lines += [f"| {_flags(a)} | {_default(a)} | {_help(parser, a)} |" for a in actions]
        lines.append("")
    if subs:
        lines += ["Subcommands: " + ", ".join(f"`{' '.join(path + [name])}`" for name, _, _ in subs) + ".", ""]
    for name, sub, help_text in subs:
        _section(path + [name], sub, help_text, lines)


def render() -> str:
    lines = [
        "# CLI reference",
        "",
        "Generated from the command line's argument parser (`tokenmill.cli.build_parser()`) when the site is "
        "built: every subcommand, every flag, its default and its help. [Command line](../cli.md) shows "
        "them in use; `tokenmill <command> --help` prints the same.",
        "",
    ]
    _section(["tokenmill"], _build_parser(), "", lines)
    return "\n".join(lines)


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=render()))
    return files


def on_serve(server, config, builder):
    server.watch(str(REPO / "src" / "tokenmill" / "cli.py"))
    return server
