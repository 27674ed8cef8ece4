"""`--dtype auto`: float32 on the CPU (bf16 was not faster there, see resolve_dtype), bf16 on accelerators;
an explicit dtype always wins."""
from __future__ import annotations

import torch

from vllmpy.loader.model_loader import resolve_dtype


def test_auto_is_float32_on_cpu_and_bf16_on_accelerators():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda")) == torch.float32
