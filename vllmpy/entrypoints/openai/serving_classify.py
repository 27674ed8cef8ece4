"""POST /classify: class probabilities per input from a sequence-classification model, labelled with
its config's id2label, as vLLM's."""
from __future__ import annotations

from vllmpy.entrypoints.openai.protocol_score import ClassificationData, ClassificationRequest, ClassificationResponse
from vllmpy.entrypoints.openai.serving_embedding import encode_all, engine_prompts
from vllmpy.entrypoints.openai.serving_engine import ServingContext, random_id, usage_info
from vllmpy.entrypoints.openai.serving_pooling import refusal, succeeded
from vllmpy.pooling_params import PoolingParams

_FIELDS = ("truncate_prompt_tokens", "use_activation", "model")


async def create_classify(ctx: ServingContext, request: ClassificationRequest) -> ClassificationResponse:
    ctx.check_base_model(request.model)
    request_id = random_id("classify")
    try:
        params = PoolingParams(task="classify", truncate_prompt_tokens=request.truncate_prompt_tokens,
                               use_activation=request.use_activation)
        outputs = await encode_all(ctx, engine_prompts(ctx, request), params, request_id, request.priority)
    except ValueError as exc:
        raise refusal(exc, _FIELDS, "input") from exc
    labels = ctx.engine.engine.core.checkpoint.config.get("id2label") or {}
    data = []
    for i, output in enumerate(succeeded(outputs)):
        probs = output.outputs.embedding
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=labels.get(str(best)), probs=probs, num_classes=len(probs)))
    return ClassificationResponse(id=request_id, model=ctx.model_name, data=data,
                                  usage=usage_info(sum(len(o.prompt_token_ids) for o in outputs), 0))
