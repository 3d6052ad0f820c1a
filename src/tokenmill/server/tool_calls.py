"""Tool calling in chat: `tools` and `tool_choice` as OpenAI defines them.

The tools reach the model through its chat template when the template knows `tools`; otherwise
a generic system prompt lists them and asks for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` lines (the Hermes format many models are trained on). `tool_choice`:
- "none": the tools are described but nothing is parsed;
- "auto" (default with tools): the answer is parsed for `<tool_call>` blocks;
- "required": the JSON-schema grammar forces a list of one or more calls of the given tools;
- {"type": "function", "function": {"name": X}}: the grammar forces the arguments of X.
A forced call (required, or a named function) cut short by max_tokens is still a call, with the
arguments as far as they got (finish_reason "length"), as OpenAI answers.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.sampling_params import GuidedDecodingParams
from tokenmill.server.errors import APIError

TOOL_SYSTEM_PROMPT = """You can call these functions (tools), given as JSON schemas:
{tools}
To call one or more of them, answer with nothing but one line per call, in this form:
<tool_call>{{"name": "<function name>", "arguments": <arguments as a JSON object>}}</tool_call>
If no function is needed, answer normally."""

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict] = field(default_factory=list)  # the `function` objects
    named: str | None = None
    guided: GuidedDecodingParams | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan_tools(tools: list[dict] | None, tool_choice) -> ToolPlan | None:
    """Validate tools / tool_choice; None when the request has no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    funcs = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                param="tools",
            )
        funcs.append(f)
    names = [f["name"] for f in funcs]
    choice = tool_choice if tool_choice is not None else "auto"
    if choice in ("none", "auto"):
        return ToolPlan(choice, funcs)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": _params(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in funcs
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return ToolPlan("required", funcs, guided=GuidedDecodingParams(json=schema))
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools {names}", param="tool_choice")
        f = funcs[names.index(name)]
        return ToolPlan("named", funcs, named=name, guided=GuidedDecodingParams(json=_params(f)))
    raise APIError(
        "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def function_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A tool in OpenAI's chat format (what plan_tools takes) from another API's fields."""
    f = {"name": name, **({"description": description} if description is not None else {})}
    return {"type": "function", "function": {**f, **({"parameters": parameters} if parameters is not None else {})}}


def _params(f: dict) -> dict:
    return f.get("parameters") or {"type": "object"}


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def add_tool_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """For templates without tool support: the tools in a system message, earlier tool calls and
    tool results as text the model can read."""
    text = TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(f) for f in plan.tools))
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            lines = [
                f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': _loads(c['function'].get('arguments'))})}</tool_call>"
                for c in calls
            ]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *lines]))
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"Result of tool call {m.pop('tool_call_id', '')}: {m.get('content', '')}"}
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _loads(args):
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args or {}


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer. Text that is not a well-formed call stays content."""
    if plan.mode == "named":
        return None, [_call(plan.named, text.strip())]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["arguments"]) for c in calls]
        except (json.JSONDecodeError, KeyError, TypeError):
            # The grammar allowed nothing but calls, so this is a list of calls cut short (by max_tokens
            # or a stop string): as OpenAI does, the calls so far, the last with partial arguments.
            return None, [_call(name, args) for name, args in cut_calls(text, [f["name"] for f in plan.tools])]
    if plan.mode == "auto":
        names = {f["name"] for f in plan.tools}
        calls = [c for c in (_parse_call(m.group(1), names) for m in _TOOL_CALL_RE.finditer(text)) if c]
        if calls:
            rest = _TOOL_CALL_RE.sub("", text).strip()
            return rest or None, calls
    return text, []


_DECODER = json.JSONDecoder()


def _skip(text: str, pos: int, chars: str = " \t\r\n") -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def cut_calls(text: str, names: list[str]) -> list[tuple[str, str]]:
    """(name, arguments JSON text) of each call in `required`'s list of calls cut short: the whole
    ones, then the one being written when it stopped (its arguments as far as they got). At least
    one call: the grammar forced one, even if the cut came before its first character."""
    calls: list[tuple[str, str]] = []
    pos = _skip(text, 0)
    if text.startswith("[", pos):
        pos += 1
        while True:
            pos = _skip(text, pos, " \t\r\n,")
            if pos >= len(text) or text[pos] != "{":
                break
            try:
                call, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                calls.append(_cut_call(text[pos:], names))
                break
            if isinstance(call, dict):
                args = call.get("arguments", {})
                calls.append((str(call.get("name", "")), args if isinstance(args, str) else json.dumps(args)))
    return calls or [(_name_from(None, names), "")]


def _cut_call(text: str, names: list[str]) -> tuple[str, str]:
    """One call object cut short (`text` starts at its `{`): its name, if written (or the only tool
    its first characters can name), and its arguments as far as they got."""
    name, prefix, args, pos = None, None, "", 1
    while True:
        pos = _skip(text, pos, " \t\r\n,")
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        pos = _skip(text, pos)
        if not text.startswith(":", pos):
            break
        pos = _skip(text, pos + 1)
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:  # the value being written when it stopped
            if key == "name" and text.startswith('"', pos):
                prefix = text[pos + 1 :].rstrip("\\")
            elif key == "arguments":
                args = text[pos:].strip()
            break
        if key == "name" and isinstance(value, str):
            name = value
        elif key == "arguments":
            args = value if isinstance(value, str) else json.dumps(value)
    return (name if name is not None else _name_from(prefix, names)), args


def _name_from(prefix: str | None, names: list[str]) -> str:
    """The tool a cut-short name can only be (the only tool, or the only one starting with the
    characters written); empty when it could still be several."""
    fits = [n for n in names if n.startswith(prefix or "")]
    return fits[0] if len(fits) == 1 else ""


def _parse_call(body: str, names: set[str]) -> dict | None:
    """The call in one `<tool_call>` block, or None if it is not JSON naming one of the tools."""
    try:
        c = json.loads(body)
    except json.JSONDecodeError:
        return None
    if isinstance(c, dict) and c.get("name") in names:
        return _call(c["name"], c.get("arguments", {}))
    return None


# ---- an answer as a stream of text and tool calls ------------------------------------------
@dataclass
class CallStart:
    id: str
    name: str


@dataclass
class CallArgs:
    delta: str


@dataclass
class CallEnd:
    arguments: str  # the whole arguments JSON


OutputEvent = str | CallStart | CallArgs | CallEnd  # a str is a piece of text


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ToolCallStream:
    """An answer's text, fed as it is generated, split into text pieces and tool calls (each a
    CallStart, CallArgs and a CallEnd): the Anthropic and Responses routes build their content
    blocks / output items, and the chat route its choices' deltas, from these, streamed or not
    (the CallArgs of a call add up to its CallEnd's arguments). With `auto`, text streams until a
    `<tool_call>` tag may begin (a possible tag prefix and trailing whitespace are held back);
    a complete block that is a call of a known tool becomes a call, anything else stays text.
    A named function streams its arguments as they come; `required` is parsed once complete."""

    def __init__(self, plan: ToolPlan | None):
        self.mode = plan.mode if plan is not None else "none"
        self.plan = plan
        self.names = {f["name"] for f in plan.tools} if plan is not None else set()
        self.buf = ""
        self.in_call = False
        self.calls = 0  # calls emitted so far
        self.after_call = False  # whitespace right after a call is dropped
        self.args = ""  # a named call's arguments so far
        self.held = ""  # whitespace after them, sent once more arguments follow

    def feed(self, delta: str) -> list[OutputEvent]:
        if self.mode == "none":
            return [delta] if delta else []
        if self.mode == "named":
            events: list[OutputEvent] = []
            if not self.calls:
                self.calls = 1
                events.append(CallStart(_call(self.plan.named, "")["id"], self.plan.named))
            text = self.held + delta if self.args else delta.lstrip()
            body = text.rstrip()  # trailing whitespace waits for more: the arguments end without it
            self.held = text[len(body) :]
            if body:
                self.args += body
                events.append(CallArgs(body))
            return events
        self.buf += delta
        return self._split() if self.mode == "auto" else []

    def finish(self) -> list[OutputEvent]:
        if self.mode == "none":
            return []
        if self.mode == "named":
            events = self.feed("") if not self.calls else []
            return events + [CallEnd(self.args)]
        if self.mode == "required":
            text, calls = parse_tool_calls(self.plan, self.buf)
            return [e for c in calls for e in _call_events(c)] if calls else ([text] if text else [])
        rest = (_OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        if self.calls:
            rest = rest.rstrip()
        return [rest] if rest else []

    def _split(self) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        while True:
            if self.in_call:
                end = self.buf.find(_CLOSE)
                if end < 0:
                    return events
                body, self.buf = self.buf[:end], self.buf[end + len(_CLOSE) :]
                self.in_call = False
                call = _parse_call(body.strip(), self.names)
                if call is None:
                    events.append(_OPEN + body + _CLOSE)
                    continue
                self.calls += 1
                self.after_call = True
                events += _call_events(call)
                continue
            if self.after_call:
                self.buf = self.buf.lstrip()
                self.after_call = not self.buf
            start = self.buf.find(_OPEN)
            if start >= 0:
                text, self.buf = self.buf[:start].rstrip(), self.buf[start + len(_OPEN) :]
                self.in_call = True
                if text:
                    events.append(text)
                continue
            keep = _held_back(self.buf)
            text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            if text:
                events.append(text)
            return events


def _held_back(text: str) -> int:
    """How many trailing characters may still turn out to precede or begin a `<tool_call>` tag:
    a prefix of the tag, and the whitespace before it."""
    keep = next((k for k in range(min(len(_OPEN) - 1, len(text)), 0, -1) if _OPEN.startswith(text[-k:])), 0)
    return len(text) - len(text[: len(text) - keep].rstrip())


def _call_events(call: dict) -> list[OutputEvent]:
    f = call["function"]
    return [CallStart(call["id"], f["name"]), CallArgs(f["arguments"]), CallEnd(f["arguments"])]


def apply_tool_grammar(params, plan: ToolPlan | None) -> ToolPlan | None:
    """Put the plan's grammar (required / named) into the SamplingParams; the plan to parse the
    answer with, or None when nothing is to be parsed."""
    if plan is not None and plan.guided is not None:
        if params.guided_decoding is not None:
            raise APIError(
                "tool_choice required or named cannot be combined with structured output "
                "(response_format, text.format or guided_*)",
                param="tool_choice",
            )
        params.guided_decoding = plan.guided
    return plan if plan is not None and plan.parses else None
