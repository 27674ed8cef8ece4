"""The scheduler's image rules: a chunk that reaches an image needs that image encoded (this step, within
the per-step encoder budget, or earlier), and for models whose attention is bidirectional inside an image
(Gemma 3) a chunk never ends inside an image's span: the span is prefilled whole, as vLLM does.

Encoding is tracked per request from the step that schedules it; the runner keeps the output until the
span's last token is computed. Preemption forgets it: the request re-encodes when it resumes.
"""
from __future__ import annotations

from vllmpy.config import SchedulerConfig
from vllmpy.engine.request import Request


class EncoderScheduler:
    def __init__(self, encoder_budget: int, token_budget: int, whole_spans: bool, chunked_prefill: bool) -> None:
        self.encoder_budget = encoder_budget  # --max-num-encoder-input-tokens: image tokens encoded per step
        self.token_budget = token_budget
        self.whole_spans = whole_spans
        self.chunked_prefill = chunked_prefill
        self._encoded: dict[str, set[int]] = {}  # request -> indices of its images encoded so far
        self._left = encoder_budget

    def check(self, request: Request) -> None:
        """Refuse a request no step could ever schedule, naming the flag to raise."""
        features = request.mm_features
        largest = max((f.length for f in features), default=0)
        if largest > self.encoder_budget:
            raise ValueError(f"an image takes {largest} tokens but --max-num-encoder-input-tokens is "
                             f"{self.encoder_budget}; raise it to at least {largest}")
        if self.whole_spans and largest > self.token_budget:
            raise ValueError(f"an image takes {largest} tokens, which this model prefills in one step, but "
                             f"--max-num-batched-tokens is {self.token_budget}; raise it to at least {largest}")
        total = sum(f.length for f in features)
        if not self.chunked_prefill and total > self.encoder_budget:
            raise ValueError(f"with chunked prefill off the prompt's {len(features)} images ({total} tokens) are "
                             f"encoded in one step, but --max-num-encoder-input-tokens is {self.encoder_budget}")

    def begin_step(self) -> None:
        self._left = self.encoder_budget

    def fit(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """The chunk [start, start + num_new) shortened to what the image rules allow, and the images to
        encode for it (0 tokens: the request waits this step). Pure: commit() once the chunk is scheduled."""
        features = request.mm_features
        if not features or num_new == 0:
            return num_new, []
        end = start + num_new
        encoded = self._encoded.get(request.request_id, ())
        to_encode: list[int] = []
        cost = 0
        for index, feature in enumerate(features):
            if not feature.overlaps(start, end):
                continue
            if self.whole_spans and end < feature.end:
                end = max(start, feature.offset)
                break
            if index not in encoded:
                if cost + feature.length > self._left:
                    end = max(start, feature.offset)
                    break
                to_encode.append(index)
                cost += feature.length
        if end == start:
            return 0, []
        return end - start, [i for i in to_encode if features[i].offset < end]

    def commit(self, request: Request, to_encode: list[int]) -> None:
        """The chunk fit() planned is scheduled: spend the encoder budget, remember the images."""
        if to_encode:
            self._left -= sum(request.mm_features[i].length for i in to_encode)
            self._encoded.setdefault(request.request_id, set()).update(to_encode)

    def forget(self, req_id: str) -> None:
        """Preempted or finished: its encoder outputs are gone from the runner."""
        self._encoded.pop(req_id, None)


def encoder_scheduler_for(model: object, config: SchedulerConfig) -> EncoderScheduler | None:
    """None for a text-only model. The encoder budget defaults to the step's token budget, and never to
    less than one image (vLLM's default), so a small --max-num-batched-tokens still serves images."""
    if not hasattr(model, "encode_images"):
        return None
    budget = config.max_num_encoder_input_tokens or max(config.max_num_batched_tokens, model.tokens_per_image)
    return EncoderScheduler(budget, config.max_num_batched_tokens,
                            bool(getattr(model, "bidirectional_image_spans", False)), config.enable_chunked_prefill)
