"""The runner's M-RoPE hook: a model whose language model rotates by 3-D positions (Qwen2.5-VL,
Qwen3-VL) computes each chunk's positions from its request's images (`model.mrope_positions`); the
step's forward gets them as `mrope_positions` [3, T], in flat batch order."""
from __future__ import annotations

import numpy as np
import torch

from vllmpy.engine.schedule_types import SchedulerOutput
from vllmpy.multimodal.encoder_cache import FeaturesOf


def mrope_inputs(model: object, so: SchedulerOutput, features_of: FeaturesOf, device: torch.device) -> dict:
    """{"mrope_positions": [3, T]} for a model that takes them, else {}."""
    positions_of = getattr(model, "mrope_positions", None)
    if positions_of is None or not so.chunks:
        return {}
    pieces = [positions_of(features_of(c.req_id), c.start_pos, c.start_pos + len(c.token_ids)) for c in so.chunks]
    return {"mrope_positions": torch.from_numpy(np.concatenate(pieces, axis=1)).to(device)}
