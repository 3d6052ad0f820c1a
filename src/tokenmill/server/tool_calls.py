"""Tool calling in chat: `tools` and `tool_choice` as OpenAI defines them.

The tools reach the model through its chat template when the template knows `tools`; otherwise
a generic system prompt lists them and asks for `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` lines (the Hermes format many models are trained on). `tool_choice`:
- "none": the tools are described but nothing is parsed;
- "auto" (default with tools): the answer is parsed for `<tool_call>` blocks;
- "required": the JSON-schema grammar forces a list of one or more calls of the given tools;
- {"type": "function", "function": {"name": X}}: the grammar forces the arguments of X.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tokenmill.server.errors import APIError
from tokenmill.structured_output import GuidedDecodingParams

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
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"{{...}}}}}}", param="tools")
        funcs.append(f)
    names = [f["name"] for f in funcs]
    choice = tool_choice if tool_choice is not None else "auto"
    if choice in ("none", "auto"):
        return ToolPlan(choice, funcs)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _params(f)},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return ToolPlan("required", funcs, guided=GuidedDecodingParams(json=schema))
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not among the tools {names}", param="tool_choice")
        f = funcs[names.index(name)]
        return ToolPlan("named", funcs, named=name, guided=GuidedDecodingParams(json=_params(f)))
    raise APIError("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                   param="tool_choice")


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
            lines = [f'<tool_call>{json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"].get("arguments"))})}</tool_call>'
                     for c in calls]
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
        except (json.JSONDecodeError, KeyError, TypeError):  # cut short by max_tokens
            return text, []
    if plan.mode == "auto":
        names = {f["name"] for f in plan.tools}
        calls = []
        for m in _TOOL_CALL_RE.finditer(text):
            try:
                c = json.loads(m.group(1))
            except json.JSONDecodeError:
                continue
            if isinstance(c, dict) and c.get("name") in names:
                calls.append(_call(c["name"], c.get("arguments", {})))
        if calls:
            rest = _TOOL_CALL_RE.sub("", text).strip()
            return rest or None, calls
    return text, []
