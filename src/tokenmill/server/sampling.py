"""A request -> SamplingParams, one mapping for every route: each API names its sampling fields
(Sampling, in OpenAI's and vLLM's names: None is SamplingParams' default, OpenAI's) and
Sampling.params builds the SamplingParams, its ValueErrors as the API's error (a 400 naming the
field; TGI: its 422). Also structured output from OpenAI's response_format and vLLM's guided_*."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from tokenmill.sampling_params import GuidedDecodingParams, SamplingParams
from tokenmill.server.errors import APIError


@dataclass
class Sampling:
    """A request's sampling fields (None: the default). max_tokens is what the request asked for
    (None: the rest of the context), resolved against the prompt by checks.resolve_max_tokens;
    max_param names it in the API's words, for error messages."""

    max_tokens: int | None = None
    max_param: str = "max_tokens"
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: dict | None = None
    bad_words: list[str] | None = None
    watermark: bool | None = None
    guided: GuidedDecodingParams | None = None

    def params(
        self, max_tokens: int, invalid: Callable[[ValueError], Exception] = APIError.from_value_error
    ) -> SamplingParams:
        """The SamplingParams for `max_tokens` (resolved); a ValueError of SamplingParams (and of the
        guided decoding fields) raised as invalid(e): by default a 400 naming the field."""
        given = {name: getattr(self, name) for name in _PASSED if getattr(self, name) is not None}
        try:
            return SamplingParams(max_tokens=max_tokens, guided_decoding=self.guided, **given)
        except ValueError as e:
            raise invalid(e) from None

    @classmethod
    def from_openai(
        cls, body, logprobs: int | None, max_tokens: int | None = None, max_param: str = "max_tokens"
    ) -> Sampling:
        """The fields of an OpenAI completions / chat request (and vLLM's extras); `logprobs` as the
        route reads its API's field (completions: logprobs; chat: top_logprobs when logprobs)."""
        return cls(
            max_tokens=max_tokens,
            max_param=max_param,
            n=body.n,
            best_of=getattr(body, "best_of", None),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            min_tokens=body.min_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            logit_bias=body.logit_bias,
            bad_words=body.bad_words,
            watermark=body.watermark,
            guided=guided_params(body, getattr(body, "response_format", None)),
        )


_PASSED = tuple(f.name for f in fields(Sampling) if f.name not in ("max_tokens", "max_param", "guided"))


def sampling_params(body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """SamplingParams of an OpenAI completions / chat request; its ValueErrors become 400s naming the field."""
    return Sampling.from_openai(body, logprobs).params(max_tokens)


def guided_params(body, response_format: dict | None = None) -> GuidedDecodingParams | None:
    """Structured output from OpenAI's response_format or vLLM's guided_* fields (one of them)."""
    given = {
        k: getattr(body, f"guided_{k}")
        for k in ("json", "regex", "choice", "grammar")
        if getattr(body, f"guided_{k}") is not None
    }
    kind = (response_format or {}).get("type", "text")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                param="response_format",
            )
    return structured_output(kind, spec["schema"] if kind == "json_schema" else None, given, "response_format")


def structured_output(
    kind: str, schema: dict | None, given: dict | None = None, param: str = "response_format"
) -> GuidedDecodingParams | None:
    """GuidedDecodingParams for an output format (text, json_object, or json_schema with `schema`),
    plus vLLM's guided_* fields in `given`; None for free text. At most one kind in all."""
    given = dict(given or {})
    if kind == "json_object":
        given["json_object"] = True
    elif kind == "json_schema":
        given["json"] = schema
    elif kind != "text":
        raise APIError(f"{param} type must be text, json_object or json_schema, got {kind!r}", param=param)
    if not given:
        return None
    if len(given) > 1:
        raise APIError(f"give one kind of structured output, not {sorted(given)}", param=param)
    try:
        return GuidedDecodingParams(**given)
    except ValueError as e:
        raise APIError(str(e), param="guided_choice" if "choice" in given else param) from None
