"""Chat-template rendering for the routes, bounded.

A chat template is a Jinja program. The model's own is trusted; one sent in a request is refused
unless the server runs with --trust-request-chat-template (as vLLM does). Every render runs on the
engine's prep pool (never the event loop or the engine thread) and is bounded three ways:
- Jinja's sandbox intercepts `*`, `**` and `+` so no expression builds a string, list or number
  past MAX_VALUE_SIZE (`{{ 'ab ' * 10000000 }}` is 109 bytes of request and 30 MB of output),
  and the output stops growing at MAX_VALUE_SIZE characters;
- a trace on the template's own frames stops a render after RENDER_TIMEOUT_S (nested loops);
- the rendered text is capped before it is tokenized (tokenizing 30 MB took 20 s and 5 GB).
"""

from __future__ import annotations

import functools
import sys
import time
import types
from contextlib import contextmanager

from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatMessage
from tokenmill.server.tool_calls import ToolPlan, add_tool_prompt, template_knows_tools

RENDER_TIMEOUT_S = 10.0
MAX_VALUE_SIZE = 8_000_000  # characters / items / digits of any one value a template computes
MIN_PROMPT_CHARS = 1_000_000  # the rendered prompt may have max(this, 32 x max_model_len) characters

# Arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_KWARGS = {
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
}


class TemplateLimitError(Exception):
    pass


def _size(x) -> int | None:
    if isinstance(x, (str, bytes, list, tuple)):
        return len(x)
    if isinstance(x, int):
        return max(x.bit_length() // 3, 1)  # ~decimal digits
    return None


def _bounded_binop(env, context, op: str, left, right):
    """Jinja's call_binop for the intercepted operators: refuse results over MAX_VALUE_SIZE."""
    a, b = _size(left), _size(right)
    if op == "*" and a is not None and b is not None:
        if isinstance(left, int) and isinstance(right, int):
            est = a + b
        else:  # a sequence times a count: its length times the count
            est = (a * right) if isinstance(right, int) else (b * left) if isinstance(left, int) else 0
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        est = a * max(right, 0)
    elif op == "+" and a is not None and b is not None:
        est = a + b
    else:
        est = 0
    if est > MAX_VALUE_SIZE:
        raise TemplateLimitError(
            f"the chat template computes a value of about {est:,} characters or items (limit {MAX_VALUE_SIZE:,})"
        )
    return env.binop_table[op](left, right)


def _checked(args):
    """Refuse a count or width past MAX_VALUE_SIZE ('a'.center(10**9), 'a'|indent(10**9))."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_VALUE_SIZE:
            raise TemplateLimitError(f"the chat template passes {a:,} to a function (limit {MAX_VALUE_SIZE:,})")
    return args


def _bounded_filter(f):
    @functools.wraps(f)  # keeps jinja's pass_context / pass_eval_context marks
    def checked(*args, **kwargs):
        _checked(args)
        _checked(kwargs.values())
        return f(*args, **kwargs)

    return checked


def install_template_bounds() -> bool:
    """Make transformers compile chat templates with the bounded operators (process-wide, once).
    False when this transformers version does not compile templates where we expect."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError:
        return False
    compile_env = getattr(ctu, "_cached_compile_jinja_template", None)
    current = getattr(ctu, "_compile_jinja_template", None)
    if compile_env is None or current is None:
        return False
    if getattr(current, "tokenmill_bounded", False):
        return True

    @functools.lru_cache(maxsize=64)
    def bounded(template: str):
        # transformers' own sandbox, filters and globals, from a fresh environment (compiling the
        # real template there would fold constants such as 10 ** 100000000 unbounded)
        env = compile_env("").environment
        env.intercepted_binops = frozenset({"*", "**", "+"})
        env.call_binop = types.MethodType(_bounded_binop, env)
        sandbox_call = env.call
        env.call = lambda context, obj, *args, **kw: sandbox_call(context, obj, *_checked(args), **kw)
        env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
        compiled = env.from_string(template)
        compiled.render = functools.partial(_render_bounded, compiled)  # type: ignore[method-assign]
        return compiled

    bounded.tokenmill_bounded = True  # type: ignore[attr-defined]
    ctu._compile_jinja_template = bounded
    return True


def _render_bounded(template, *args, **kwargs) -> str:
    """Template.render, refusing output past MAX_VALUE_SIZE characters as it is produced."""
    pieces, n = [], 0
    for piece in template.generate(*args, **kwargs):
        n += len(piece)
        if n > MAX_VALUE_SIZE:
            raise TemplateLimitError(f"the chat template's output passed {MAX_VALUE_SIZE:,} characters")
        pieces.append(piece)
    return "".join(pieces)


@contextmanager
def render_deadline(seconds: float):
    """Raise TemplateLimitError inside a Jinja template's code once `seconds` have passed
    (this thread only; the trace is removed afterwards)."""
    end = time.monotonic() + seconds

    def in_template(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateLimitError(f"rendering the chat template took longer than {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        f"messages[{i}]: content part of type {part.type!r} is not supported; only text parts are",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        elif content is None:
            content = ""
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def render_chat(
    ctx,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    kwargs: dict | None,
    tools: ToolPlan | None = None,
) -> list[int]:
    """The prompt's token ids: messages through the chat template (blocking: run on the prep pool)."""
    if chat_template is not None and not ctx.trust_request_chat_template:
        raise APIError(
            "a chat_template in the request is refused: this server uses the model's template "
            "(start it with --trust-request-chat-template to accept templates from clients)",
            param="chat_template",
        )
    if add_generation_prompt and continue_final_message:
        raise APIError(
            "add_generation_prompt and continue_final_message cannot both be true; "
            "set add_generation_prompt to false to continue the last message",
            param="continue_final_message",
        )
    msgs = messages_to_dicts(messages)
    if continue_final_message and msgs[-1]["role"] != "assistant":
        raise APIError(
            "continue_final_message needs the last message to be an assistant message", param="continue_final_message"
        )
    kw = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_KWARGS}
    template = chat_template or ctx.chat_template
    if template:
        kw["chat_template"] = template
    if tools is not None:
        if template_knows_tools(template or getattr(ctx.engine.tokenizer, "chat_template", None)):
            kw["tools"] = [{"type": "function", "function": f} for f in tools.tools]
        else:
            msgs = add_tool_prompt(msgs, tools)
    if continue_final_message:
        kw["continue_final_message"] = True
    try:
        with render_deadline(RENDER_TIMEOUT_S):
            text = ctx.engine.render_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kw)
    except TemplateLimitError as e:
        raise APIError(str(e), param="chat_template" if chat_template else "messages") from None
    except ValueError as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages") from None
    except Exception as e:  # noqa: BLE001 - a Jinja error in the template or the messages
        raise APIError(f"the chat template failed on these messages: {e}", param="messages") from None
    limit = max(MIN_PROMPT_CHARS, 32 * ctx.max_model_len)
    if len(text) > limit:
        raise APIError(
            f"the rendered chat has {len(text):,} characters, more than this server tokenizes for "
            f"one prompt ({limit:,})",
            param="messages",
        )
    return ctx.encode(text, add_special_tokens=False, param="messages")
