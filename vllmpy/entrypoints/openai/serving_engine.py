"""What every route shares: the served model, prompt checks, SamplingParams from a request, engine streams."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Any

from vllmpy.engine.async_llm import AsyncLLM
from vllmpy.engine.llm_engine import PromptType
from vllmpy.entrypoints.openai.chat_images import load_chat_images
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import ChatMessage, ChatRenderFields, SamplingRequest, UsageInfo
from vllmpy.entrypoints.openai.serving_models import ServingModels
from vllmpy.metrics import RequestTracker, ServerMetrics
from vllmpy.multimodal.chat import template_content, template_takes_parts
from vllmpy.multimodal.media import MediaConfig
from vllmpy.outputs import RequestOutput
from vllmpy.sampling_params import SamplingParams, StructuredOutputsParams
from vllmpy.tokenizer import ChatTemplateError, Tokenizer
from vllmpy.tokenizer.chat_template import RESERVED_KWARGS

# OpenAI's documented logit_bias range; vLLM clamps to it too.
LOGIT_BIAS_LIMIT = 100.0
# Sampling fields a request may leave unset to get the checkpoint's generation_config value.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """Bytes of the longest vocabulary entry as written (a bound on the text any one token covers)."""
    longest = 1
    for token_id in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.id_to_token(token_id).encode("utf-8")))
        except ValueError:  # an id the vocabulary skips
            continue
    return longest


class ServingContext:
    """The loaded engine plus the server-wide settings the routes read."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], model_root: str, *,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.model_root = model_root
        self.max_model_len: int = engine.engine.core.max_model_len
        self.models = ServingModels(engine, served_model_names, model_root, self.max_model_len)  # + LoRA adapters
        self.vocab_size: int = engine.engine.core.vocab_size
        self.max_num_seqs: int = engine.engine.core.config.scheduler.max_num_seqs
        self.max_logprobs: int = engine.engine.core.config.model.max_logprobs
        # A text longer than this needs more than max_model_len tokens, so it is refused before tokenizing.
        self.max_prompt_bytes = self.max_model_len * longest_token_bytes(self.tokenizer)
        self.default_params = engine.engine.default_sampling_params
        self.chat_template = chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.metrics = ServerMetrics(engine.stats, self.model_name, engine.info_metrics())
        core = engine.engine.core
        self.mm_processor = core.mm_processor  # None: a text-only model (image parts are refused)
        self.media = MediaConfig.of(core.config.model)  # where image_url parts may be read from
        self._stop_future: asyncio.Future | None = None

    def check_truncation(self, truncate_prompt_tokens: int | None) -> None:
        """vLLM's bound: keeping more tokens than max_model_len can serve is refused (and never reaches the
        tokenizer, whose integers are bounded)."""
        if truncate_prompt_tokens is not None and truncate_prompt_tokens > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than max_model_len "
                               f"({self.max_model_len}); choose a smaller truncation size", "truncate_prompt_tokens")

    def check_model(self, model: str | None) -> None:
        """A served name or a LoRA adapter's; 404 otherwise."""
        self.models.lora_request(model)

    def check_base_model(self, model: str | None) -> None:
        """The pooling routes (embeddings, pooling, score, rerank, classify) serve the base model only: an
        adapter's name is refused rather than answered by the base model."""
        if model in self.models.lora_requests:
            raise RequestError(f"`{model}` is a LoRA adapter, which this route does not serve; send the base "
                               f"model's name {self.model_name!r}", "model")
        self.check_model(model)

    def response_model(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name for a request on one (as vLLM), else ours."""
        return model if model in self.models.lora_requests else self.model_name

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise RequestError(f"prompt length {size} bytes exceeds the maximum allowed prompt length of "
                               f"{self.max_prompt_bytes} bytes", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def chat_prompt(self, request: ChatRenderFields) -> dict:
        """The rendered conversation as an engine prompt: text, token ids and, with image_url parts, the
        loaded images (each marker expanded into its placeholder tokens before tokenizing)."""
        images = await load_chat_images([m.model_dump(exclude_none=True) for m in request.messages],
                                        self.mm_processor, self.media, self.engine.engine.core._arch)
        text = self.render_chat(request)
        if images:
            try:
                text = self.mm_processor.expand_prompt(text, images, "messages")
            except ValueError as exc:
                raise RequestError(str(exc), "messages") from None
        prompt = {"prompt": text, "prompt_token_ids": self.encode(text, request.add_special_tokens, "messages")}
        return {**prompt, "multi_modal_data": {"image": images}} if images else prompt

    def render_chat(self, request: ChatRenderFields) -> str:
        """The conversation as the chat template writes it, with server defaults under the request's kwargs."""
        request.check_render()
        kwargs = {**self.chat_template_kwargs, **(request.chat_template_kwargs or {})}
        reserved = sorted(RESERVED_KWARGS & set(kwargs))
        if reserved:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server supplies "
                               f"{'it' if len(reserved) == 1 else 'them'}", "chat_template_kwargs")
        if self.chat_template is None and self.tokenizer.chat_template is None:
            raise RequestError("this model has no chat template, so chat messages cannot be rendered; start "
                               "the server with --chat-template <file or template>", "messages")
        marker = None if self.mm_processor is None else (self.mm_processor.layout.chat_marker
                                                         or self.mm_processor.layout.marker)
        takes_parts = template_takes_parts(self.chat_template or self.tokenizer.chat_template)
        try:
            return self.tokenizer.apply_chat_template(
                [_template_message(m, marker, takes_parts) for m in request.messages],
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, tools=request.tools,
                chat_template=self.chat_template, chat_template_kwargs=kwargs)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), "messages") from exc

    def sampling_params(self, request: SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None, renames: dict[str, str],
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams; a value out of range is refused naming the request's field."""
        if request.n > self.max_num_seqs:  # one request may not outnumber a step's sequences (n=10000 ran minutes)
            raise RequestError(f"n must be at most {self.max_num_seqs} (the server's --max-num-seqs, the most "
                               f"sequences the engine runs at once), got {request.n}", "n")
        model_defaults = {k: getattr(self.default_params, k) for k in _MODEL_DEFAULTS}
        sent = {k: v for k in _MODEL_DEFAULTS if (v := getattr(request, k)) is not None}
        bias = {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, v)) for t, v in (request.logit_bias or {}).items()}
        try:
            return SamplingParams(
                **{**model_defaults, **sent}, n=request.n, seed=request.seed, stop=request.stop,
                stop_token_ids=request.stop_token_ids, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, logit_bias=bias or None,
                min_tokens=request.min_tokens, ignore_eos=request.ignore_eos, max_tokens=max_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                structured_outputs=structured_outputs)
        except ValueError as exc:
            raise _refusal(exc, request, renames) from exc

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """Refuse a budget the context cannot hold (an over-long prompt is the engine's to refuse)."""
        if max_tokens is None or num_prompt_tokens >= self.max_model_len:
            return
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestError(
                f"{param} is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({max_tokens} > {self.max_model_len} - {num_prompt_tokens})", param)

    async def start(self, prompt: PromptType, params: SamplingParams, request: SamplingRequest,
                    request_id: str, *, delta: bool, renames: dict[str, str]) -> EngineStream:
        """Submit and wait for the first output, so the engine's refusal arrives before any response."""
        stream = EngineStream(
            self.engine.generate(prompt, params, request_id=request_id, priority=request.priority, delta=delta,
                                 lora_request=self.models.lora_request(request.model)),
            self.metrics.track(), self._stopped())
        try:
            await stream.wait_first()
        except ValueError as exc:
            raise _refusal(exc, request, renames) from exc
        return stream

    def stop(self) -> None:
        """End every in-flight stream with a 503 and refuse new ones (the server is shutting down)."""
        if not self._stopped().done():
            self._stopped().set_result(None)

    def _stopped(self) -> asyncio.Future:
        if self._stop_future is None:  # created on first use, inside the server's event loop
            self._stop_future = asyncio.get_running_loop().create_future()
        return self._stop_future


class EngineStream:
    """One submitted request's outputs, observed for the metrics; aclose() before the end aborts it."""

    def __init__(self, stream: AsyncGenerator[RequestOutput, None], tracker: RequestTracker,
                 stopped: asyncio.Future) -> None:
        self._stream = stream
        self._tracker = tracker
        self._stopped = stopped
        self._first: RequestOutput | None = None

    async def wait_first(self) -> None:
        self._first = await self._next()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        output = self._first
        while output is not None:
            self._tracker.observe(output)
            yield output
            output = await self._next()

    async def aclose(self) -> None:
        await self._stream.aclose()  # aborts the request in the engine unless it finished
        self._tracker.close()

    async def _next(self) -> RequestOutput | None:
        """The next output (None after the last), unless the server stops first."""
        step = asyncio.ensure_future(anext(self._stream, None))
        try:
            await asyncio.wait((step, self._stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not step.done():  # stopping, or our own task was cancelled: abort the request
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        if step.cancelled():
            raise RequestError("the server is shutting down; the request was aborted", None,
                               HTTPStatus.SERVICE_UNAVAILABLE)
        return step.result()


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def check_finished(output: RequestOutput) -> None:
    """A request the engine failed (not the client's fault) surfaces as a 500 naming the cause."""
    if output.error is not None:
        raise RequestError(f"generation failed inside the engine: {output.error}", None,
                           HTTPStatus.INTERNAL_SERVER_ERROR)


def _refusal(exc: ValueError, request: SamplingRequest, renames: dict[str, str]) -> RequestError:
    """A SamplingParams or engine refusal in the request's own words: a message that starts with a renamed
    field ("logprobs asks for 21 ...") says the route's name for it ("top_logprobs asks for 21 ...")."""
    message = str(exc)
    word, space, rest = message.partition(" ")
    if word in renames:
        message = renames[word] + space + rest
    return RequestError(message, _param_of(str(exc), request, renames))


def _param_of(message: str, request: SamplingRequest, renames: dict[str, str]) -> str | None:
    """SamplingParams and the engine start their messages with the field at fault (or a part of it, as
    "structured_outputs.json:", which is looked up as its field)."""
    word = message.split(" ", 1)[0].rstrip(":").split(".", 1)[0]
    if word in renames:
        return renames[word]
    return word if word in type(request).model_fields else None


def _template_message(message: ChatMessage, image_marker: str | None, takes_parts: bool) -> dict[str, Any]:
    """A message as chat templates expect it: content a string (text parts joined by newlines, as vLLM's
    string content format) unless it has images and the template reads parts (multimodal/chat.py),
    tool-call arguments as objects."""
    out = message.model_dump(exclude_none=True)
    try:
        out["content"] = template_content(out.get("content"), image_marker, takes_parts)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    for call in out.get("tool_calls") or []:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass  # templates that print arguments verbatim still work with the string
    return out
