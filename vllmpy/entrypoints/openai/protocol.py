"""Request and response bodies of the HTTP server: OpenAI's fields plus vLLM's extensions, same names.

Requests check JSON types strictly (no "5" for 5, no true for 1) and declare each field's range, so that
/openapi.json states what the server accepts; SamplingParams enforces the same ranges for the offline API,
and the limits that depend on the engine (vocabulary, --max-logprobs, --max-num-seqs, max_model_len) are
checked where the engine is known. A JSON null means "not sent", and unknown fields are kept for the server
to log rather than refused, as vLLM does.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    Tag,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.json_limits import check_json_body

_INT64 = 2**63


def _integer(value: Any) -> Any:
    """JSON Schema's integer: 5 and 5.0, not true or "5" (which lax ints would take)."""
    if isinstance(value, (bool, str)):
        raise ValueError("Input should be a valid integer")
    return value


def _integer_type(**limits: int) -> Any:
    """A request's integer field: integral numbers within `limits` (the limits sit inside the validator so
    that the schema shows them as minimum / maximum)."""
    return Annotated[int, Field(strict=False, **limits), BeforeValidator(_integer)]


Int = _integer_type()
NonNegative = _integer_type(ge=0)
Positive = _integer_type(ge=1)
AtLeastMinusOne = _integer_type(ge=-1)  # -1 = "all" (logprobs: the whole vocabulary; top_k: no cut)
Int64 = _integer_type(ge=-_INT64, lt=_INT64)
TokenId = NonNegative
# JSON object keys are strings: a logit_bias key is a token id written in digits (SamplingParams makes it an int).
_DIGITS = r"^[0-9]+$"
LogitBias = Annotated[dict[Annotated[str, Field(pattern=_DIGITS)], float], WithJsonSchema(
    {"type": "object", "propertyNames": {"pattern": _DIGITS}, "additionalProperties": {"type": "number"}})]
# A list that must not be empty (an empty prompt or token list has nothing to work on).
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Texts = Annotated[list[str], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
PromptInput = Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)], NonEmptyText,
                    Annotated[list[NonEmptyText], Field(min_length=1)]]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        """The schema says what _null_means_unset does: an optional field may be sent as null."""
        json_schema = handler(core_schema)
        target = handler.resolve_ref_schema(json_schema)
        required = set(target.get("required", ()))
        for name, prop in target.get("properties", {}).items():
            if name not in required and prop.get("type") != "null" and {"type": "null"} not in prop.get("anyOf", ()):
                notes = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
                target["properties"][name] = {**notes, "anyOf": [prop, {"type": "null"}]}
        return json_schema


class RequestBody(RequestModel):
    """A route's whole body: checked as a whole (nesting depth, valid Unicode) before any field."""

    @model_validator(mode="before")
    @classmethod
    def _check_whole_body(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_json_body(data)
        return data


_SENT = {"not": {"type": "null"}}  # null is "not sent"


def _when(field: str, value: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema if/then for a check() rule: when `field` is sent matching `value`, `then` holds."""
    return {"if": {"required": [field], "properties": {field: value}}, "then": then}


def _must_be(field: str, value: Any) -> dict[str, Any]:
    return {"required": [field], "properties": {field: {"const": value}}}


# check()'s field-combination rules, stated in the schema too.
_SAMPLING_RULES = [
    _when("stream", {"const": True}, {"properties": {"prompt_logprobs": {"type": "null"}}}),
    _when("stream_options", _SENT, _must_be("stream", True)),
]
_RENDER_RULES = [_when("continue_final_message", {"const": True}, _must_be("add_generation_prompt", False))]
_CHAT_RULES = [_when("top_logprobs", _SENT, _must_be("logprobs", True))]


# ---------------------------------------------------------------- requests


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None  # true: no undeclared properties anywhere (structured_output/strict.py)


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # instructor's non-standard {"type": "json_object", "schema": {...}} (Together's and Anyscale's shape)
    object_schema: dict[str, Any] | None = Field(None, alias="schema")


class SamplingRequest(RequestBody):
    """Fields both generation routes share."""

    model_config = ConfigDict(json_schema_extra={"allOf": _SAMPLING_RULES})

    model: str | None = None  # None = the served model
    n: Positive = Field(1, description="choices to generate; at most the server's --max-num-seqs")
    temperature: float | None = Field(None, ge=0)  # None = the checkpoint's generation_config, else 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: AtLeastMinusOne | None = Field(None, description="0 or -1 = no top-k cut")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    logit_bias: LogitBias | None = None
    min_tokens: NonNegative = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: AtLeastMinusOne | None = Field(None, description="top logprobs per prompt token; -1 = the whole "
                                        "vocabulary; at most the server's --max-logprobs")
    priority: Int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Output constraints; structured.py maps them and allows one per request.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields, checked there
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Texts | None = None
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
    prompt: PromptInput
    echo: bool = False
    suffix: Annotated[str | None, WithJsonSchema({"type": "null", "description": "not supported"})] = None
    logprobs: AtLeastMinusOne | None = Field(None, description="top logprobs per generated token; -1 = the whole "
                                 "vocabulary; at most the server's --max-logprobs")
    max_tokens: Positive | None = None  # None = until max_model_len
    best_of: Positive | None = Field(None, description="only best_of == n is served (no ranking of extra samples)")
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")
        # best_of > n would rank extra samples by cumulative logprob, which this server does not do.
        if self.best_of is not None and self.best_of != self.n:
            relation = "less than" if self.best_of < self.n else "more than"
            raise RequestError(f"best_of ({self.best_of}) is {relation} n ({self.n}); only best_of equal to n is "
                               f"supported (it returns all n samples), so leave best_of out or set it to n",
                               "best_of")


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str  # data:image/...;base64,..., http(s)://..., or file://... under --allowed-local-media-path
    detail: Literal["auto", "low", "high"] | None = None  # accepted, as vLLM; the processor decides the size


class ImageURLContentPart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageURLContentPart, Field(discriminator="type")]


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(RequestModel):
    model_config = ConfigDict(json_schema_extra={  # the rule _tool_result_names_its_call enforces
        "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}})

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_parts_only(cls, data: Any) -> Any:
        """A part of another type (input_audio, video_url) is refused by what it is, not by a union error."""
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url"):
                raise ValueError(f"content parts of type {kind!r} need a multimodal model that takes them; this "
                                 f"server takes parts of type 'text' and 'image_url' (images need a "
                                 f"vision-language model)")
        return data

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' needs tool_call_id, the id of the assistant's tool call "
                             "it answers")
        return self


class ChatRenderFields(RequestBody):
    """What it takes to render a conversation into a prompt (chat and /tokenize share it)."""

    model_config = ConfigDict(json_schema_extra={"allOf": _RENDER_RULES})

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
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
    parameters: dict[str, Any] | None = None  # a JSON schema; None = no parameters (OpenAI's reading)
    strict: bool | None = None  # forced calls never write undeclared properties, strict or not


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest, ChatRenderFields):
    model_config = ConfigDict(json_schema_extra={"allOf": _SAMPLING_RULES + _RENDER_RULES + _CHAT_RULES})

    logprobs: bool = False
    top_logprobs: NonNegative | None = Field(None, description="at most the server's --max-logprobs")
    max_tokens: Positive | None = None  # OpenAI's older name for max_completion_tokens
    max_completion_tokens: Positive | None = None
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


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatRenderFields):
    return_token_strs: bool = False


def _tokenize_kind(data: Any) -> str:
    return "messages" if isinstance(data, dict) and "messages" in data else "prompt"


# A body with messages is a chat render; refusals then name its fields, not the missing prompt.
TokenizeRequest = Annotated[Union[Annotated[TokenizeCompletionRequest, Tag("prompt")],
                                  Annotated[TokenizeChatRequest, Tag("messages")]], Discriminator(_tokenize_kind)]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings fields plus vLLM's truncate_prompt_tokens, add_special_tokens, normalize, priority."""

    model: str | None = None
    input: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)], NonEmptyText,
                 Annotated[list[NonEmptyText], Field(min_length=1)]]  # nothing empty: an empty input has no vector
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None  # Matryoshka models only
    user: str | None = None
    truncate_prompt_tokens: Int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: Int = 0


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
