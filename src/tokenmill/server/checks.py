"""Input checks the generation routes share, in vLLM's words: the model (or LoRA adapter) a
request names, sampling fields SamplingParams does not check, token ids, logprobs, the context
length."""

from __future__ import annotations

import dataclasses
import logging

from tokenmill.lora.request import LoRARequest
from tokenmill.server.context import ServerContext
from tokenmill.server.errors import APIError

logger = logging.getLogger("tokenmill.server")


def check_model(ctx: ServerContext, name: str | None) -> LoRARequest | None:
    """The LoRA adapter a request's `model` names: None for the base model (its served name, or no
    name), the adapter's LoRARequest for a registered adapter (--enable-lora); else a 404."""
    if not name or name == ctx.model_name or name in ctx.model_aliases:
        return None
    lora = lora_request(ctx, name)
    if lora is None:
        adapters = " and the LoRA adapters listed by GET /v1/models" if ctx.lora is not None else ""
        raise APIError(
            f"The model `{name}` does not exist. This server serves `{ctx.model_name}`{adapters}.", 404, "model"
        )
    return lora


def lora_request(ctx: ServerContext, name: str) -> LoRARequest | None:
    """The registered adapter of this name, as a request by name only: the prep thread takes the
    registry's loaded copy (an adapter unloaded meanwhile is a 400 there, never loaded again)."""
    registry = ctx.lora
    known = registry.lookup(name) if registry is not None else None
    return dataclasses.replace(known, lora_path="") if known is not None else None


def served_name(ctx: ServerContext, lora: LoRARequest | None) -> str:
    """The `model` of a response: the adapter's name, else the served model name (as vLLM)."""
    return lora.lora_name if lora is not None else ctx.model_name


def log_ignored_fields(body) -> None:
    extra = getattr(body, "model_extra", None)
    if extra:
        logger.warning("ignored request fields: %s", sorted(extra))


def check_sampling_fields(ctx: ServerContext, body) -> None:
    """Checks shared by completions and chat that SamplingParams does not make."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {body.n}", param="n")
    if body.logit_bias:
        try:
            ids = [int(k) for k in body.logit_bias]
        except ValueError:
            raise APIError("logit_bias keys must be token ids", param="logit_bias") from None
        check_token_ids(ctx, ids, "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")
    if body.stop_token_ids:
        check_token_ids(ctx, body.stop_token_ids, "stop_token_ids")
    check_logprobs(ctx, body.prompt_logprobs, "prompt_logprobs")
    check_priority(ctx, body.priority)


def check_priority(ctx: ServerContext, priority: int) -> None:
    try:
        ctx.engine.check_priority(priority)
    except ValueError as e:
        raise APIError(str(e), param="priority") from None


def check_token_ids(ctx: ServerContext, ids: list[int], param: str) -> None:
    vocab = ctx.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(f"token ids must be integers in [0, {vocab})", param=param)


def resolve_max_tokens(
    ctx: ServerContext, n_prompt: int, max_tokens: int | None, what: str = "prompt", param: str = "max_tokens"
) -> int:
    """vLLM's rule: the prompt plus max_tokens must fit the context; no max_tokens means the rest."""
    limit = ctx.max_model_len
    if n_prompt == 0:
        raise APIError(f"the {what} is empty", param=what)
    if n_prompt >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your request has {n_prompt} "
            f"input tokens in the {what}, which leaves no room for output (at most {limit - 1}). "
            f"Please reduce the length of the {what}.",
            param=what,
        )
    if max_tokens is None:
        return limit - n_prompt
    if max_tokens < 1:
        raise APIError(f"{param} must be at least 1, got {max_tokens}", param=param)
    if n_prompt + max_tokens > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.",
            param=param,
        )
    return max_tokens


MAX_N = 128  # samples per prompt (n or best_of)
MAX_SEQUENCES = 1024  # engine requests one API request may start (prompts x samples)


def check_logprobs(ctx: ServerContext, n: int | None, param: str) -> None:
    limit = min(ctx.max_logprobs, ctx.vocab_size)
    if n is not None and not 0 <= n <= limit:
        raise APIError(f"{param} must be in [0, {limit}], got {n}", param=param)
