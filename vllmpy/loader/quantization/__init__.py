"""Quantized safetensors checkpoints (GPTQ, AWQ, compressed-tensors, fp8), repacked at load into the
CPU block kernels' blocks: see config.py (what is supported), formats.py (on-disk layouts), blocks.py."""
from vllmpy.loader.quantization.config import QuantConfig, parse_quantization_config
from vllmpy.loader.quantization.weights import QuantizedSafetensors

__all__ = ["QuantConfig", "QuantizedSafetensors", "parse_quantization_config"]
