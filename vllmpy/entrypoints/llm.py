"""The offline API: `LLM(model=None, **engine_args).generate(...)` / `.chat(...)` / `.embed(...)` /
`.classify(...)` / `.score(...)` / `.encode(...)`, as vLLM's."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from tqdm import tqdm

from vllmpy.config import EngineConfig
from vllmpy.engine.llm_engine import LLMEngine, PromptType
from vllmpy.entrypoints.score_utils import PairScorer, as_texts, check_scoring_task, pair_up
from vllmpy.lora.request import LoRARequest
from vllmpy.multimodal.chat import load_conversation_images
from vllmpy.multimodal.media import MediaConfig
from vllmpy.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer import Tokenizer


class LLM:
    """Loads a checkpoint once (the embedded default model when `model` is None) and serves batches."""

    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None,
                 **engine_args) -> None:
        self.config = engine_config or EngineConfig.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one per prompt (None: the base model)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._submit(prompts, sampling_params, "sampling_params", use_tqdm, priority, lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              priority: list[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (needs an embedding model: BertModel, LlamaModel, ... or --task embed).

        `truncate_prompt_tokens` overrides the pooling params' own (keep the last N tokens; -1 =
        max_model_len)."""
        params = _with(pooling_params, truncate_prompt_tokens, "embed")
        return self._submit(prompts, params, "pooling_params", use_tqdm, priority)

    def classify(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 priority: list[int] | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (needs a *ForSequenceClassification model)."""
        params = _with(pooling_params, truncate_prompt_tokens, "classify")
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.embedding),
                                            o.prompt_token_ids)
                for o in _succeeded(self._submit(prompts, params, "pooling_params", use_tqdm, priority))]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, priority: list[int] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """The pooler's raw output as a tensor: the embedding, or a classifier's activated logits."""
        params = _with(pooling_params, truncate_prompt_tokens, pooling_task or self.engine.core.task)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(o.outputs.embedding)),
                                     o.prompt_token_ids)
                for o in _succeeded(self._submit(prompts, params, "pooling_params", use_tqdm, priority))]

    def score(self, data_1: str | list[str], data_2: str | list[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score per pair (one data_1 against every data_2, or pairwise): a cross-encoder's relevance,
        or for an embedding model the cosine similarity of the two embeddings, as vLLM."""
        core = self.engine.core
        check_scoring_task(core.task)
        params = dataclasses.replace(pooling_params or PoolingParams(), truncate_prompt_tokens=truncate_prompt_tokens)
        scorer = PairScorer(core.task, self.get_tokenizer(), pair_up(as_texts(data_1), as_texts(data_2)), params)
        prompts = [prompt for prompt, _ in scorer.requests]
        outputs = _succeeded(self._submit(prompts, [p for _, p in scorer.requests], "pooling_params", use_tqdm, None))
        return [ScoringRequestOutput(str(i), ScoringOutput(score), token_ids)
                for i, (score, token_ids) in enumerate(scorer.scores(outputs))]

    def _submit(self, prompts: PromptType | Sequence[PromptType],
                params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams], params_name: str,
                use_tqdm: bool, priority: list[int] | None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} {params_name} for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = self.engine.new_request_id()
            self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0,
                                    lora_request=loras[i])
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        core = self.engine.core
        for conversation in conversations:
            conversation, images = load_conversation_images(  # image_url / image_pil parts, as vLLM's
                conversation, core.mm_processor, MediaConfig.of(self.config.model), core._arch,
                chat_template or tokenizer.chat_template)
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            if images:  # each marker becomes its image's placeholder tokens before tokenizing
                text = core.mm_processor.expand_prompt(text, images, "messages")
            # The template already carries BOS and friends.
            prompt = {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
            prompts.append({**prompt, "multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or None,
                  leave=False) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[i] for i in request_ids]


def _with(params: PoolingParams | Sequence[PoolingParams] | None, truncate_prompt_tokens: int | None,
          task: str) -> PoolingParams | list[PoolingParams]:
    """The pooling params (default ones when None) for `task`, with `truncate_prompt_tokens` when given."""
    changes = {"task": task} if truncate_prompt_tokens is None else {
        "task": task, "truncate_prompt_tokens": truncate_prompt_tokens}
    if params is None or isinstance(params, PoolingParams):
        return dataclasses.replace(params or PoolingParams(), **changes)
    return [dataclasses.replace(p, **changes) for p in params]


def _succeeded(outputs: list[EmbeddingRequestOutput]) -> list[EmbeddingRequestOutput]:
    """A prompt the engine failed raises here: a class or score list must not hold a silent gap."""
    failed = next((o for o in outputs if o.error is not None), None)
    if failed is not None:
        raise RuntimeError(f"pooling failed inside the engine: {failed.error}")
    return outputs
