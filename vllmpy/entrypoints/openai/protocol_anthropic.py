"""Bodies of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) and of its answers.

Messages carry text, tool_use and tool_result blocks; thinking blocks sent back are accepted and not
re-rendered (chat templates drop earlier turns' reasoning). Only client tools (name, input_schema) are served.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Discriminator, Field, Tag, model_validator

from vllmpy.entrypoints.openai.protocol import NonNegative, Positive, RequestBody, RequestModel
from vllmpy.entrypoints.openai.text_or_list import text_or_list

# ---------------------------------------------------------------- requests


class TextBlockParam(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: text_or_list(list[TextBlockParam]) = ""
    is_error: bool = False


class ThinkingBlockParam(RequestModel):
    type: Literal["thinking", "redacted_thinking"]


def _block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else None
    return "thinking" if kind == "redacted_thinking" else kind


ContentBlockParam = Annotated[
    Union[Annotated[TextBlockParam, Tag("text")], Annotated[ToolUseBlockParam, Tag("tool_use")],
          Annotated[ToolResultBlockParam, Tag("tool_result")], Annotated[ThinkingBlockParam, Tag("thinking")]],
    Discriminator(_block_kind, custom_error_type="content_block", custom_error_message=(
        "a content block is an object of type text, tool_use, tool_result, thinking or redacted_thinking "
        "(this model takes text only: no image or document blocks)"))]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: text_or_list(list[ContentBlockParam])


class ToolParam(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"server tools (type {kind!r}) are not served; send client tools: name, description "
                             f"and input_schema")
        return data


class ToolChoiceParam(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _tool_names_its_tool(self) -> ToolChoiceParam:
        if self.type == "tool" and self.name is None:
            raise ValueError("a tool_choice of type 'tool' needs name, the tool the model must call")
        return self


class ThinkingParam(RequestModel):
    # disabled sets the template's enable_thinking to false, the others to true; the budget is not enforced.
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Positive | None = None


class JsonOutputFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's reasoning_effort
    format: JsonOutputFormat | None = None


class PromptFields(RequestBody):
    """What both routes render: the conversation, system prompt and tools."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: text_or_list(list[TextBlockParam]) | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension


class MessagesRequest(PromptFields):
    max_tokens: Positive
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: NonNegative | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(PromptFields):
    pass


# ---------------------------------------------------------------- responses


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; a local model's has nothing to verify


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextContent, ThinkingContent, ToolUseContent]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str
    param: str | None = None  # beyond Anthropic's shape: the request field at fault, as on the OpenAI routes


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
