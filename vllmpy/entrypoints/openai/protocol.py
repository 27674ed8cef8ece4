"""Request and response bodies of the HTTP server: OpenAI's fields plus vLLM's extensions, same names.

Requests check JSON types and request-shape rules here; value ranges (temperature, top_p, n, ...) are
SamplingParams' to enforce, so each rule lives in one place. A JSON null means "not sent", and unknown
fields are kept for the server to log rather than refused, as vLLM does.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllmpy.entrypoints.openai.errors import RequestError

_INT64 = 2**63


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# ---------------------------------------------------------------- requests


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None  # the grammar always enforces the schema exactly


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(RequestModel):
    """Fields both generation routes share."""

    model: str | None = None  # None = the served model
    n: int = 1
    temperature: float | None = None  # None = the checkpoint's generation_config, else 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Output constraints; structured.py maps them and allows one per request.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields, checked there
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check(self) -> None:
        """Refuse field combinations no single field's type can rule out."""
        if self.stream and self.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not available when stream is true", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be set when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    max_tokens: int | None = None  # None = until max_model_len
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: str  # system, developer, user, assistant, tool, or whatever the template knows
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatRenderFields(RequestModel):
    """What it takes to render a conversation into a prompt (chat and /tokenize share it)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already writes BOS and friends
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check_render(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true; "
                               "set add_generation_prompt to false", "continue_final_message")


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None = any object


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest, ChatRenderFields):
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None  # OpenAI's older name for max_completion_tokens
    max_completion_tokens: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def check(self) -> None:
        super().check()
        self.check_render()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        self._check_tools()

    @property
    def resolved_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default when unset: "auto" if tools are sent, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def _check_tools(self) -> None:
        """tools stay plain dicts (templates render them as sent); their shape is checked here."""
        if self.tools is not None:
            if not self.tools:
                raise RequestError("tools must not be an empty list; leave it out instead", "tools")
            for i, tool in enumerate(self.tools):
                try:
                    ChatTool.model_validate(tool)
                except ValidationError as exc:
                    where = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                    raise RequestError(f"tools[{i}] is not a function tool ({where})", "tools") from None
        if self.tool_choice is None or self.tool_choice == "none":
            return
        if not self.tools:
            raise RequestError("tool_choice needs tools: send the functions the model may call", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool["function"]["name"] for tool in self.tools]
            if self.tool_choice.function.name not in names:
                raise RequestError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                   f"in tools ({', '.join(names)})", "tool_choice")


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatRenderFields):
    return_token_strs: bool = False


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings fields plus vLLM's truncate_prompt_tokens, add_special_tokens, normalize, priority."""

    model: str | None = None
    input: list[int] | list[list[int]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka models only
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0


# ---------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


def _omitted_when_none() -> Any:
    """A field left out of the JSON while None (stream chunks carry usage and delta parts only when set)."""
    return Field(None, exclude_if=lambda value: value is None)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllmpy"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class PromptLogprob(BaseModel):
    """One token's entry in a prompt_logprobs position, as vLLM serializes its Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token: None for the first, else {token id: PromptLogprob}.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = _omitted_when_none()


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = _omitted_when_none()  # with --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = _omitted_when_none()
    arguments: str | None = _omitted_when_none()


class DeltaToolCall(BaseModel):
    """A piece of one call: the first has id, type and name; later ones add argument text."""

    index: int
    id: str | None = _omitted_when_none()
    type: Literal["function"] | None = _omitted_when_none()
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omitted_when_none()
    content: str | None = _omitted_when_none()
    reasoning_content: str | None = _omitted_when_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_when_none()


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = _omitted_when_none()


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 bytes


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo
