"""LoRA adapters: PEFT checkpoints served on top of the base model, many adapters in one batch."""
from vllmpy.lora.request import LoRARequest

__all__ = ["LoRARequest"]
