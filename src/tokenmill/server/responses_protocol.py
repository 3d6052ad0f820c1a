"""Request and response models of OpenAI's Responses API (pydantic), the subset this server
serves: text input and output, function tools and their calls, JSON-schema output, stored
responses. Unknown fields are accepted and ignored (logged), as on the other OpenAI routes; input
this server cannot take (images, files, built-in tools) is a 400 saying what it takes."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, Discriminator, Field, Tag

from tokenmill.server.protocol import OpenAIBaseModel, SchedulingExtras


# ---- input ---------------------------------------------------------------------------------
class ResponsesInputText(OpenAIBaseModel):
    type: Literal["input_text", "output_text"] = Field(..., description="output_text in an assistant message")
    text: str


# Text parts only: any other type (input_image, input_file, ...) is a 400 naming the two accepted.
ResponsesContentPart = ResponsesInputText


def _text_to_parts(v: Any) -> Any:
    return [{"type": "input_text", "text": v}] if isinstance(v, str) else v


class ResponsesInputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(..., description="developer is a system message")
    content: Annotated[
        list[ResponsesContentPart],
        BeforeValidator(_text_to_parts, json_schema_input_type=Union[str, list[ResponsesContentPart]]),
    ]


class ResponsesFunctionCallInput(OpenAIBaseModel):
    """An earlier answer's function call (as the response's output gave it)."""

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="the arguments as JSON text")


class ResponsesFunctionCallOutput(OpenAIBaseModel):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[ResponsesContentPart]


class ResponsesReasoningInput(OpenAIBaseModel):
    """An earlier answer's reasoning item: accepted and left out of the prompt."""

    type: Literal["reasoning"]


def _item_type(v: Any) -> str | None:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)


ResponsesInputItem = Annotated[
    Annotated[ResponsesInputMessage, Tag("message")]
    | Annotated[ResponsesFunctionCallInput, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutput, Tag("function_call_output")]
    | Annotated[ResponsesReasoningInput, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="item_type",
        custom_error_message="input items must be messages, function_call, function_call_output or reasoning items",
    ),
]


def _text_to_items(v: Any) -> Any:
    return [{"type": "message", "role": "user", "content": v}] if isinstance(v, str) else v


ResponsesInput = Annotated[
    list[ResponsesInputItem],
    Field(min_length=1),
    BeforeValidator(_text_to_items, json_schema_input_type=Union[str, list[ResponsesInputItem]]),
]


class ResponsesFunctionTool(OpenAIBaseModel):
    type: Literal["function"] = Field(..., description="function tools only (no built-in tools)")
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(
        None,
        description="accepted: with tool_choice required or a named function the arguments always follow the schema",
    )


class ResponsesToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class ResponsesFormatText(OpenAIBaseModel):
    type: Literal["text"]


class ResponsesFormatJSONObject(OpenAIBaseModel):
    type: Literal["json_object"]


class ResponsesFormatJSONSchema(OpenAIBaseModel):
    type: Literal["json_schema"]
    name: str = Field(..., min_length=1)
    schema_: dict[str, Any] = Field(..., alias="schema", description="the output follows this JSON schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesTextConfig(OpenAIBaseModel):
    format: (
        Annotated[
            ResponsesFormatText | ResponsesFormatJSONObject | ResponsesFormatJSONSchema, Field(discriminator="type")
        ]
        | None
    ) = None


class ResponsesRequest(OpenAIBaseModel, SchedulingExtras):
    UNION_FIELDS: ClassVar[dict[str, str]] = {  # errors.py's wording when a value matches no arm
        "input": "a string or a list of input items (messages, function_call, function_call_output)"
    }
    model: str | None = Field(None, description="served model name; omitted means the served model")
    input: ResponsesInput = Field(..., description="text (a user message), or a list of input items")
    instructions: str | None = Field(
        None, description="a system message first (not carried over by previous_response_id)"
    )
    max_output_tokens: int | None = Field(None, ge=1, description="new tokens at most (default: up to the context)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 is greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call with tool_choice required")
    text: ResponsesTextConfig | None = None
    stream: bool = False
    store: bool = Field(
        True,
        description="keep the response (in memory, the last --max-stored-responses) for "
        "GET /v1/responses/{id} and previous_response_id",
    )
    previous_response_id: str | None = Field(None, description="continue the conversation of a stored response")
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, description="accepted and ignored")
    background: bool | None = Field(None, description="not supported: true is a 400")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="accepted; the input is never truncated (a conversation past the context is a 400)"
    )


# ---- output --------------------------------------------------------------------------------
class ResponsesOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponsesOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[ResponsesOutputText]


class ResponsesFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


ResponsesOutputItem = Annotated[ResponsesOutputMessage | ResponsesFunctionCall, Field(discriminator="type")]


class ResponsesInputTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from the prefix cache


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails = Field(default_factory=ResponsesOutputTokensDetails)
    total_tokens: int


class ResponsesIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: ResponsesIncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponsesOutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponsesUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponsesDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# ---- stream events (documentation: the route writes them as `event: <type>` + `data: <json>`) ----
class ResponsesLifecycleEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponsesResponse
    sequence_number: int


class ResponsesItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: ResponsesOutputItem
    sequence_number: int


class ResponsesContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: ResponsesOutputText
    sequence_number: int


class ResponsesTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]
    sequence_number: int


class ResponsesTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]
    sequence_number: int


class ResponsesArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class ResponsesArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


class ResponsesErrorEvent(BaseModel):
    type: Literal["error"]
    code: str | None
    message: str
    param: str | None
    sequence_number: int


STREAM_EVENTS = (
    ResponsesLifecycleEvent,
    ResponsesItemEvent,
    ResponsesContentPartEvent,
    ResponsesTextDeltaEvent,
    ResponsesTextDoneEvent,
    ResponsesArgumentsDeltaEvent,
    ResponsesArgumentsDoneEvent,
    ResponsesErrorEvent,
)
