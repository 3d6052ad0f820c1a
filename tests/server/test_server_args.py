"""ServerArgs: the server flags of `tokenmill serve`, defined once; its fields are the flags, the
CLI's namespace maps back onto it, and the Ray ingress reads a named subset of the same fields."""

from __future__ import annotations

import argparse
import dataclasses

from tokenmill.cli import build_parser
from tokenmill.server.args import RAY_INGRESS_FIELDS, ServerArgs


def _serve_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["serve"]._actions}


def test_every_field_is_a_flag_with_its_default_and_help(monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    actions = _serve_actions()
    for f in dataclasses.fields(ServerArgs):
        action = actions[f.name]
        assert action.option_strings == ["--" + f.name.replace("_", "-")]
        assert action.default == f.default and action.help == f.metadata["help"], f.name
    ns = build_parser().parse_args(["serve"])
    assert ServerArgs.from_cli_args(ns) == ServerArgs()


def test_flags_parse_into_server_args(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    ns = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--drain-timeout",
            "2.5",
            "--disable-web-ui",
            "--uvicorn-log-level",
            "debug",
            "--chat-template",
            str(template),
            "--max-request-body-bytes",
            "0",
        ]
    )
    args = ServerArgs.from_cli_args(ns)
    assert (args.port, args.drain_timeout, args.disable_web_ui, args.uvicorn_log_level) == (9001, 2.5, True, "debug")
    assert args.api_key == "from-env" and "from-env" not in repr(args)  # the key stays out of logs
    assert args.body_limit is None and args.log_requests
    assert args.with_chat_template_file().chat_template == "{{ messages }}"
    assert ServerArgs(chat_template="{{ x }}").with_chat_template_file().chat_template == "{{ x }}"


def test_the_ray_ingress_reads_server_args_fields():
    from tokenmill.server.context import ServerContext

    names = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(RAY_INGRESS_FIELDS) <= names
    ctx = ServerContext(aengine=None, model_name="m", metrics=None, args=ServerArgs(api_key="k", max_logprobs=5))
    assert (ctx.api_key, ctx.max_logprobs) == ("k", 5)
    ctx.max_prompts_per_request = 4  # the context's flags are its ServerArgs' fields
    assert ctx.args.max_prompts_per_request == 4
