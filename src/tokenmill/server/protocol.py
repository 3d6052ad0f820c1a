"""Request and response models of the OpenAI-compatible API (pydantic), in vLLM's shapes.

Request models type every field so /openapi.json documents them, ranges included: what the
server enforces statically (temperature in [0, 100], top_p in (0, 1], penalties in [-2, 2],
n <= 128, list sizes, ...) is stated in Field(ge/gt/le/lt/min_length/max_length) and checked
by pydantic (a 400 whose message names the field and its range, see errors.py); SamplingParams
checks the sampling rules again for the offline API. What depends on the model or the server's
flags (vocabulary size, context length, --max-logprobs) is checked by the routes. Numbers must
be finite (JSON parsers accept NaN and Infinity); token ids are JSON integers (not booleans,
floats or strings). Unknown fields are accepted and ignored (logged), as vLLM does, so clients
that send newer OpenAI fields keep working.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

from tokenmill.sampling_params import SamplingParams

# Seeds travel to torch.Generator.manual_seed: a signed 64-bit range, as vLLM accepts.
_SEED_MIN, _SEED_MAX = SamplingParams.SEED_MIN, SamplingParams.SEED_MAX
MAX_N = 128  # samples per prompt (n, best_of, beams): serving.MAX_N
LENGTH_PENALTY_MAX = 10.0  # |length_penalty|: beam scores divide by length ** it (a float power)
# List sizes a request may carry: each entry costs work per request (bad words are tokenized) or
# per generated token (stop strings are matched after every token).
MAX_STOP = 64
MAX_BAD_WORDS = 1024
MAX_TOKEN_ID_LIST = 1024  # stop_token_ids, logit_bias entries


def _json_integer(v: Any) -> Any:
    """A JSON integer and nothing else: pydantic's lax int takes true (Python's bool is an int) and
    "5"; 5.0 stays accepted, as JSON Schema's "integer" counts it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return v


# A token id: a JSON integer >= 0 (false, "1" and 1.5 are refused); its upper bound, the
# vocabulary size, is checked by the routes.
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_json_integer)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# Keys are token ids written as strings of digits; the schema says so with propertyNames (pydantic
# alone would write patternProperties, which lets any other key through).
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=MAX_TOKEN_ID_LIST),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": MAX_TOKEN_ID_LIST,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0},
        }
    ),
]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def _inline_schema(model: type[BaseModel]) -> dict:
    """A model's JSON schema with its $defs substituted (no $ref), for where /openapi.json's
    components do not reach (the JSON inside SSE events)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def sub(x):
        if isinstance(x, dict):
            if "$ref" in x:
                return sub(defs[x["$ref"].rsplit("/", 1)[-1]])
            return {k: sub(v) for k, v in x.items()}
        return [sub(v) for v in x] if isinstance(x, list) else x

    return sub(schema)


def sse_content(*models: type[BaseModel], done: bool) -> dict:
    """OpenAPI `content` of a Server-Sent Events response: each event's data is the JSON of one of
    `models` (or, with `done`, the literal [DONE] that ends OpenAI streams)."""
    data: dict = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [_inline_schema(m) for m in models]},
    }
    if done:
        data = {"type": "string", "if": {"const": "[DONE]"}, "then": True, "else": data}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}


# ---- errors ------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared pieces -------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = Field(True, description="send a last chunk with the usage of the whole request")
    continuous_usage_stats: bool | None = Field(False, description="vLLM extra: usage in every chunk")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def from_outputs(cls, outs, prompt_tokens: int | None = None) -> UsageInfo:
        """Summed over the (latest) RequestOutputs of one API request, every sample of each;
        `prompt_tokens` when the outputs repeat a prompt (one per sample)."""
        outs = list(outs)
        p = sum(len(o.prompt_token_ids) for o in outs) if prompt_tokens is None else prompt_tokens
        c = sum(len(x.token_ids) for o in outs for x in o.outputs)
        cached = sum(o.num_cached_tokens for o in outs)
        return cls(
            prompt_tokens=p,
            completion_tokens=c,
            total_tokens=p + c,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


# Rules across fields, stated in the schema too (the routes check them): stream_options needs stream.
_STREAM_OPTIONS_RULE = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


class SchedulingExtras(BaseModel):
    """vLLM's per-request scheduling extras, on every generation route's body (serving.new_tracker reads them)."""

    priority: int = Field(
        0,
        ge=-(2**63),
        le=2**63 - 1,
        description="vLLM extra: with --scheduling-policy priority, lower values are scheduled "
        "first (ties by arrival); anything but 0 is refused under fcfs",
    )
    cache_salt: NonEmptyStr | None = Field(
        None,
        description="vLLM extra: the prompt shares prefix-cache blocks only with requests of the same salt "
        "(tenant isolation)",
    )


class _SamplingFields(OpenAIBaseModel, SchedulingExtras):
    """Sampling fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_RULE]})

    model: str | None = Field(None, description="served model name; omitted means the served model")
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = Field(
        None, description="token id (a string of digits, below the vocabulary size) -> bias added to its logit"
    )
    n: int | None = Field(
        1, ge=1, le=MAX_N, description="completions per prompt (the samples share the prompt's KV blocks)"
    )
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX, description="same seed, same output")
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"stop strings (at most {MAX_STOP}), never included in the output"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(
        None, ge=0.0, le=SamplingParams.TEMPERATURE_MAX, description="0 is greedy (default 1)"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="default 1")
    user: str | None = Field(None, description="accepted and ignored")
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=SamplingParams.TOP_K_MAX, description="vLLM extra: -1 or 0 disables")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extra")
    repetition_penalty: float | None = Field(
        None,
        ge=SamplingParams.REPETITION_PENALTY_MIN,
        le=SamplingParams.REPETITION_PENALTY_MAX,
        description="vLLM extra: 1 disables",
    )
    min_tokens: int = Field(0, ge=0, description="vLLM extra: no EOS / stop token before this many tokens")
    ignore_eos: bool = Field(False, description="vLLM extra: keep generating past EOS")
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_TOKEN_ID_LIST, description="vLLM extra: token ids that end generation"
    )
    include_stop_str_in_output: bool = Field(False, description="vLLM extra")
    skip_special_tokens: bool = Field(True, description="vLLM extra: drop special tokens from the text")
    spaces_between_special_tokens: bool = Field(True, description="vLLM extra")
    bad_words: list[NonEmptyStr] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="vLLM extra: words never generated"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        description="vLLM extra: each prompt token's logprob plus the top N (N <= the server's --max-logprobs)",
    )
    use_beam_search: bool = Field(False, description="vLLM extra: beam search with n beams (not streamed)")
    length_penalty: float = Field(
        1.0,
        ge=-LENGTH_PENALTY_MAX,
        le=LENGTH_PENALTY_MAX,
        description="vLLM extra: beam scores are logprob / length ** this",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extra: output follows this JSON schema")
    guided_regex: str | None = Field(None, description="vLLM extra: output matches this regex")
    guided_choice: list[NonEmptyStr] | None = Field(
        None, min_length=1, description="vLLM extra: output is one of these strings"
    )
    guided_grammar: str | None = Field(None, description="vLLM extra: output follows this grammar (Lark or GBNF)")
    watermark: bool = Field(
        False,
        description="tokenmill extra: green-list watermark (Kirchenbauer et al.; "
        "detect with `tokenmill watermark detect`)",
    )


# ---- /v1/completions ---------------------------------------------------------------------
# A prompt (an embeddings input): token ids, lists of them, a string or strings; none of them empty.
PromptInput = Union[
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    NonEmptyStr,
    Annotated[list[NonEmptyStr], Field(min_length=1)],
]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput = Field(
        ...,
        description="a string, a list of strings, token ids, or a list of token id lists (none of them empty; "
        "at most the server's --max-prompts-per-request prompts)",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_N,
        description="completions generated per prompt, the n with the highest "
        "cumulative logprob returned; not with stream",
    )
    echo: bool | None = Field(False, description="prepend the prompt to the completion")
    logprobs: int | None = Field(
        None,
        ge=0,
        description="log probabilities of the sampled token and the top N "
        "(N <= the server's --max-logprobs, default 20)",
    )
    max_tokens: int | None = Field(
        16,
        ge=0,
        description="new tokens at most (the prompt and them must fit the "
        "context; 0 only with echo, to score the prompt); "
        "null: up to the context length",
    )
    suffix: str | None = Field(None, description="not supported: refused with 400")
    add_special_tokens: bool = Field(True, description="vLLM extra: add BOS etc. when tokenizing the prompt")


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(None, description="the stop string or token id that ended generation")
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        None, description="vLLM extra: per prompt token, {token id: {logprob, rank, decoded_token}}; null first"
    )


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion (documentation; chunks are built by hand)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------
class ChatContentPart(OpenAIBaseModel):
    # The schema states what the route accepts (a text part); the model takes any part, so that
    # the route can name the part it refuses (e.g. image_url).
    model_config = ConfigDict(
        json_schema_extra={
            "properties": {
                "type": {"const": "text", "type": "string", "description": "only 'text' is supported"},
                "text": {"type": "string"},
            },
            "required": ["type", "text"],
        }
    )
    type: str = Field(..., description="only 'text' is supported")
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str = Field(..., description="system, user, assistant (or any role the chat template knows)")
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant turn's earlier tool calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _STREAM_OPTIONS_RULE,
                {  # top_logprobs needs logprobs
                    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                },
            ]
        }
    )
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool | None = Field(False, description="return log probabilities of the output tokens")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        description="top alternatives per token (N <= the server's --max-logprobs, default 20), needs logprobs",
    )
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI in favour of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: up to the context)")
    response_format: dict[str, Any] | None = Field(
        None,
        description="{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
        "{'name': ..., 'schema': {...}}}: the output always parses (and follows the schema)",
    )
    tools: list[dict[str, Any]] | None = Field(None, description="functions the model may call (OpenAI's format)")
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="none, auto (default with tools), required, or {'type': 'function', 'function': {'name': ...}}",
    )
    # vLLM extras
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant turn's header")
    continue_final_message: bool = Field(
        False, description="leave the last (assistant) message open and continue it; excludes add_generation_prompt"
    )
    chat_template: str | None = Field(None, description="a Jinja chat template to use instead of the model's")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra variables for the chat template")


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(None, description="vLLM extra, as in completions")


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (documentation; chunks are built by hand)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/embeddings ----------------------------------------------------------------------
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = Field(None, description="served model name; omitted means the served model")
    input: PromptInput = Field(
        ...,
        description=f"a string, a list of strings, token ids, or a list of token id lists (none of them "
        f"empty; at most {MAX_EMBEDDING_INPUTS} inputs, each at most the model's max_model_len "
        f"tokens)",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes"
    )
    dimensions: int | None = Field(
        None, ge=1, description="keep the first N dimensions (normalised again); Matryoshka models only"
    )
    user: str | None = Field(None, description="accepted and ignored")
    # vLLM extras
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="vLLM extra: cut longer inputs to this many tokens instead of refusing them (-1: max_model_len)",
    )
    normalize: bool | None = Field(None, description="vLLM extra: L2-normalise (default: the model's pooler)")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str = Field(..., description="the vector, or its float32 bytes in base64")
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---- models, tokenize, detokenize --------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId] = Field(..., description="token ids below the vocabulary size")


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: Literal["ok", "loading", "failed", "unhealthy"]
    phase: str | None = Field(None, description="while loading: what the load is doing, e.g. 'loading weights'")
    done: int | None = Field(None, description="while loading: items of the phase done (with total, unit)")
    total: int | None = None
    unit: str | None = None
    elapsed_s: float | None = Field(None, description="while loading: seconds since the load started")
    error: str | None = Field(None, description="failed: why the engine did not load")


# ---- LoRA adapters at run time (--allow-runtime-lora-updating) -----------------------------
class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(..., min_length=1, description="the name requests give as `model` (or TGI's adapter_id)")
    lora_path: str = Field(..., min_length=1, description="a PEFT adapter folder on the server")


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(..., min_length=1)
    lora_int_id: int | None = Field(None, description="vLLM's; ignored (adapters are unloaded by name)")
