"""The runner's side of images: run the vision encoder once per image in the step the scheduler names it,
keep its rows until the step that computes the span's last token, and hand the forward the rows to splice
(flat batch positions + embeddings) and the spans attention treats as bidirectional."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllmpy.engine.schedule_types import SchedulerOutput
from vllmpy.multimodal.inputs import ImageFeature

FeaturesOf = Callable[[str], list[ImageFeature]]


class EncoderCache:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        # Gemma 3: attention is bidirectional inside each image's span (the model declares it).
        self.bidirectional = bool(getattr(model, "bidirectional_image_spans", False))
        self._outputs: dict[str, dict[int, torch.Tensor]] = {}  # request -> image index -> [length, hidden]

    def forget(self, req_id: str) -> None:
        self._outputs.pop(req_id, None)

    def model_inputs(self, so: SchedulerOutput, features_of: FeaturesOf) -> dict:
        """{"mm_embeds": (flat rows, embeddings)} for this step's placeholder tokens, or {} when none."""
        self._encode(so, features_of)
        rows: list[torch.Tensor] = []
        pieces: list[torch.Tensor] = []
        flat = 0
        for chunk in so.chunks:
            start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            for index, feature in enumerate(features_of(chunk.req_id)):
                if not feature.overlaps(start, end):
                    continue
                outputs = self._outputs.get(chunk.req_id, {})
                if index not in outputs:
                    raise RuntimeError(f"request {chunk.req_id}: image {index} reaches this step but was never "
                                       f"encoded (a scheduler bug)")
                lo, hi = max(start, feature.offset), min(end, feature.end)
                positions, taken = feature.embedding_rows(lo, hi)
                rows.append(torch.from_numpy(positions + (flat - start)).to(self.device))
                pieces.append(outputs[index][taken])
                if hi == feature.end:  # its span is complete: no later step reads it
                    del outputs[index]
            flat += end - start
        if not rows:
            return {}
        return {"mm_embeds": (torch.cat(rows), torch.cat(pieces))}

    def attention_spans(self, so: SchedulerOutput, features_of: FeaturesOf) -> list[list[tuple[int, int]]] | None:
        """Per chunk, the image spans [offset, end) its queries reach, for a bidirectional model; else None."""
        if not self.bidirectional:
            return None
        spans = []
        for chunk in so.chunks:
            start, end = chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            spans.append([(f.offset, f.end) for f in features_of(chunk.req_id) if f.overlaps(start, end)])
        return spans if any(spans) else None

    def _encode(self, so: SchedulerOutput, features_of: FeaturesOf) -> None:
        """One tower call per pixel shape: every image of that size this step, batched."""
        by_shape: dict[tuple[int, ...], list[tuple[str, int, np.ndarray]]] = {}
        for chunk in so.chunks:
            features = features_of(chunk.req_id)
            for index in chunk.encoder_inputs:
                pixels = features[index].pixel_values
                by_shape.setdefault(pixels.shape, []).append((chunk.req_id, index, pixels))
        for items in by_shape.values():
            batch = torch.from_numpy(np.stack([pixels for _, _, pixels in items])).to(self.device)
            embeds = self.model.encode_images(batch)
            for (req_id, index, _), rows in zip(items, embeds):
                self._outputs.setdefault(req_id, {})[index] = rows
