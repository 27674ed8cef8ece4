"""The offline API: `LLM(model=None, **engine_args).generate(...)` / `.chat(...)` / `.embed(...)`, as vLLM's."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm import tqdm

from vllmpy.config import EngineConfig
from vllmpy.engine.llm_engine import LLMEngine, PromptType
from vllmpy.outputs import EmbeddingRequestOutput, RequestOutput
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
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._submit(prompts, sampling_params, "sampling_params", use_tqdm, priority)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              priority: list[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (needs an embedding model: BertModel, LlamaModel, ... or --task embed).

        `truncate_prompt_tokens` overrides the pooling params' own (keep the last N tokens; -1 =
        max_model_len)."""
        if pooling_params is None:
            pooling_params = PoolingParams()
        if truncate_prompt_tokens is not None:
            if isinstance(pooling_params, PoolingParams):
                pooling_params = dataclasses.replace(pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
            else:
                pooling_params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                                  for p in pooling_params]
        return self._submit(prompts, pooling_params, "pooling_params", use_tqdm, priority)

    def _submit(self, prompts: PromptType | Sequence[PromptType],
                params: SamplingParams | PoolingParams | Sequence[SamplingParams | PoolingParams], params_name: str,
                use_tqdm: bool, priority: list[int] | None) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} {params_name} for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            request_id = self.engine.new_request_id()
            self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            # The template already carries BOS and friends.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

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
