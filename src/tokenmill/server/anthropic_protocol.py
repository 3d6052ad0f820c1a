"""Request and response models of Anthropic's Messages API (pydantic), the subset this server
serves: text, tool_use and tool_result blocks, custom tools. Ranges are Anthropic's
(temperature in [0, 1]); unknown fields are accepted and ignored (logged), as on the OpenAI routes,
so newer clients keep working. Blocks this server cannot take (images, documents, ...) are a 400
naming the block types it does take."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import MAX_STOP, NonEmptyStr, SchedulingExtras


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


# ---- content blocks --------------------------------------------------------------------------
class AnthropicTextBlock(AnthropicBaseModel):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(AnthropicBaseModel):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]


class AnthropicToolResultBlock(AnthropicBaseModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[AnthropicTextBlock] | None = Field(None, description="the result, as text (text blocks only)")
    is_error: bool | None = Field(None, description="the result is an error (the model reads 'Error: ...')")


class AnthropicThinkingBlock(AnthropicBaseModel):
    """An earlier turn's thinking: accepted and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


def _block_type(v: Any) -> str | None:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "thinking" if t == "redacted_thinking" else t


AnthropicContentBlock = Annotated[
    Annotated[AnthropicTextBlock, Tag("text")]
    | Annotated[AnthropicToolUseBlock, Tag("tool_use")]
    | Annotated[AnthropicToolResultBlock, Tag("tool_result")]
    | Annotated[AnthropicThinkingBlock, Tag("thinking")],
    Discriminator(
        _block_type,
        custom_error_type="block_type",
        custom_error_message="content blocks must be of type text, tool_use, tool_result or thinking "
        "(images, documents and other blocks are not supported)",
    ),
]


def _text_to_blocks(v: Any) -> Any:
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


# A string, or a list of blocks; either way the route sees blocks.
AnthropicContent = Annotated[
    list[AnthropicContentBlock],
    BeforeValidator(_text_to_blocks, json_schema_input_type=Union[str, list[AnthropicContentBlock]]),
]


class AnthropicMessageParam(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    content: AnthropicContent


class AnthropicTool(AnthropicBaseModel):
    type: Literal["custom"] | None = Field(None, description="custom tools only (no server tools)")
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(..., description="a JSON schema of the tool's input")


class AnthropicToolChoiceAuto(AnthropicBaseModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = Field(None, description="accepted; not enforced with auto")


class AnthropicToolChoiceAny(AnthropicBaseModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = Field(None, description="true: exactly one call")


class AnthropicToolChoiceTool(AnthropicBaseModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class AnthropicToolChoiceNone(AnthropicBaseModel):
    type: Literal["none"]


AnthropicToolChoice = Annotated[
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceTool | AnthropicToolChoiceNone,
    Field(discriminator="type"),
]


class AnthropicConversation(AnthropicBaseModel):
    model: str = Field(..., min_length=1, description="the served model name (or a LoRA adapter's)")
    messages: list[AnthropicMessageParam] = Field(
        ..., min_length=1, description="a last assistant message is continued"
    )
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class AnthropicJSONOutputFormat(AnthropicBaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema", description="the output follows this JSON schema")


class AnthropicOutputConfig(AnthropicBaseModel):
    format: AnthropicJSONOutputFormat | None = Field(None, description="structured output (effort is ignored)")


class AnthropicMessagesRequest(AnthropicConversation, SchedulingExtras):
    max_tokens: int = Field(..., ge=1, description="new tokens at most (the prompt and them must fit the context)")
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = Field(
        None, description="strings that end generation (not included in the text)"
    )
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="0 is greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=SamplingParams.TOP_K_MAX, description="0 disables")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    output_config: AnthropicOutputConfig | None = None
    stream: bool = False


class AnthropicCountTokensRequest(AnthropicConversation):
    pass


# ---- responses -------------------------------------------------------------------------------
class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicTextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


AnthropicStopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnthropicTextOut | AnthropicToolUseOut]
    stop_reason: AnthropicStopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# ---- stream events (documentation: the route writes them as `event: <type>` + `data: <json>`) ----
class AnthropicMessageStartEvent(BaseModel):
    type: Literal["message_start"]
    message: AnthropicMessage


class AnthropicContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"]
    index: int
    content_block: AnthropicTextOut | AnthropicToolUseOut


class AnthropicTextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class AnthropicInputJSONDelta(BaseModel):
    type: Literal["input_json_delta"]
    partial_json: str


class AnthropicContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"]
    index: int
    delta: AnthropicTextDelta | AnthropicInputJSONDelta


class AnthropicContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"]
    index: int


class AnthropicMessageDelta(BaseModel):
    stop_reason: AnthropicStopReason | None
    stop_sequence: str | None


class AnthropicMessageDeltaEvent(BaseModel):
    type: Literal["message_delta"]
    delta: AnthropicMessageDelta
    usage: AnthropicUsage


class AnthropicMessageStopEvent(BaseModel):
    type: Literal["message_stop"]


class AnthropicPingEvent(BaseModel):
    type: Literal["ping"]


STREAM_EVENTS = (
    AnthropicMessageStartEvent,
    AnthropicContentBlockStartEvent,
    AnthropicContentBlockDeltaEvent,
    AnthropicContentBlockStopEvent,
    AnthropicMessageDeltaEvent,
    AnthropicMessageStopEvent,
    AnthropicPingEvent,
    AnthropicErrorResponse,
)
