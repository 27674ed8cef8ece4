"""Bodies of POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and of the response object.

Input items are messages (text parts only), function_call and function_call_output items, and reasoning
items (accepted so that a client can send a response's output back as input; their text is not re-rendered,
as chat templates drop earlier turns' reasoning). Only function tools are served.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import AtLeastMinusOne, Int64, Positive, RequestBody, RequestModel
from vllmpy.entrypoints.openai.text_or_list import text_or_list

# ---------------------------------------------------------------- requests


class InputText(RequestModel):
    """A text part; output_text parts (a previous response's, sent back) read the same."""

    type: Literal["input_text", "output_text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise ValueError(f"content parts of type {kind!r} are not served: this model takes text only, so send "
                             f"input_text parts (or content as a string)")
        return data


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or_list(list[InputText])


class FunctionCallInput(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the response's function_call item carried it


class FunctionCallOutputInput(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: text_or_list(list[InputText])


class ReasoningInput(RequestModel):
    type: Literal["reasoning"]


def _item_kind(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else None


InputItem = Annotated[
    Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallInput, Tag("function_call")],
          Annotated[FunctionCallOutputInput, Tag("function_call_output")],
          Annotated[ReasoningInput, Tag("reasoning")]],
    Discriminator(_item_kind, custom_error_type="input_item", custom_error_message=(
        "an input item is an object whose type is message (the default when it has a role), function_call, "
        "function_call_output or reasoning"))]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tools of type {kind!r} are not served; only function tools (type 'function') are")
        return data


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a format of type 'json_schema' needs schema, the JSON schema the output must follow")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    # "none" turns thinking off (enable_thinking=false); any effort reaches the template as reasoning_effort.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: text_or_list(Annotated[list[InputItem], Field(min_length=1)])
    instructions: str | None = None  # a system message; not carried on by previous_response_id (as OpenAI)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Positive | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extensions
    top_k: AtLeastMinusOne | None = None
    seed: Int64 | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if self.background:
            raise RequestError("background responses are not supported; leave background out or false",
                               "background")


# ---------------------------------------------------------------- responses


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Union[OutputMessage, ReasoningItem, FunctionCallItem]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    truncation: str = "disabled"
    background: bool = False
