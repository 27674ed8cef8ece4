"""`quantization_config` of a safetensors checkpoint: which modules are quantized, and how.

Every field is checked here, from config.json alone, so an unsupported variant is refused by field
and value before a header is parsed or a weight read. Which modules the config names is checked
against the checkpoint's tensor names afterwards (`QuantConfig.plan`), still before any weight data.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.quantization.mxfp4 import PROJECTIONS as MXFP4_PROJECTIONS
from vllmpy.loader.safetensors import TensorInfo

# Layouts: how a quantized module's tensors sit on disk (vllmpy/loader/quantization/formats.py reads each).
GPTQ, AWQ, PACKED, NAIVE_INT, FP8, MXFP4 = "gptq", "awq", "pack-quantized", "int-quantized", "fp8", "mxfp4"
SUPPORTED_METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "mxfp4")
# The keys an mxfp4 config may hold (openai/gpt-oss: quant_method, modules_to_not_convert; vLLM reads
# ignored_layers; dequantize is a transformers load option): any other names a variant not read here.
_MXFP4_FIELDS = ("quant_method", "modules_to_not_convert", "ignored_layers", "dequantize")
_CT_FORMATS = {"pack-quantized": PACKED, "int-quantized": NAIVE_INT, "naive-quantized": NAIVE_INT,
               "float-quantized": FP8}
# Modules nn.Linear never is: a compressed-tensors "Linear" target skips them.
_NOT_LINEAR = re.compile(r"(embed_tokens|embeddings?|wte|wpe|embed_positions)$")


@dataclass(frozen=True)
class Scheme:
    """How one module's weight is stored: `bits`-wide integers (w = scale * (q - zero)) in groups of
    `group_size` input columns (-1: one per output row), or (layout FP8) e4m3 bytes whose scale is per
    tensor / per row / per `block` [rows, cols]."""

    layout: str
    bits: int = 8
    group_size: int = -1
    symmetric: bool = True
    block: tuple[int, int] | None = None
    gptq_v1_zeros: bool = False  # checkpoint_format "gptq": stored zero points are zero - 1


def _refuse(field: str, value: object, allowed: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"quantization_config {field}={value!r} is not supported; supported: {allowed}")


def _group_size(field: str, value: object) -> int:
    """-1 (per output row) or a positive multiple of 32: the packed blocks hold 32 values and one scale."""
    if value is None:
        return -1
    if not isinstance(value, int) or not (value == -1 or (value > 0 and value % 32 == 0)):
        raise _refuse(field, value, "-1 (per channel) or a positive multiple of 32")
    return value


def _choice(config: dict, field: str, allowed: tuple, default: object = None) -> object:
    value = config.get(field, default)
    if isinstance(value, str):
        value = value.lower()
    if value not in allowed:
        raise _refuse(field, value, ", ".join(map(str, allowed)))
    return value


def _names(config: dict, *fields: str) -> list[str]:
    for field in fields:
        if config.get(field):
            return list(config[field])
    return []


@dataclass
class QuantConfig:
    """The parsed config: (targets, scheme) groups in config order, and the modules left dense."""

    method: str
    groups: list[tuple[list[str], Scheme]]
    ignore: list[str]
    # GPTQ / AWQ / fp8 quantize whatever the checkpoint stores quantized; compressed-tensors names it.
    by_targets: bool

    def plan(self, tensors: dict[str, TensorInfo]) -> dict[str, Scheme]:
        """module -> scheme for the quantized modules, from the shard headers' tensor names, dtypes and
        shapes. Refuses a config naming a module the checkpoint does not have."""
        modules = {name.rsplit(".", 1)[0] for name in tensors if "." in name}
        for name in self.ignore:
            # A tied checkpoint stores no lm_head, yet llm-compressor lists it: the model still has one.
            if name != "lm_head" and not name.startswith("re:") and not any(_is_under(m, name) for m in modules):
                raise UnsupportedCheckpointError(
                    f"quantization_config ignores module {name!r}, which the checkpoint does not have")
        if not self.by_targets:
            scheme = self.groups[0][1]
            found = {m: scheme for m in modules if _stores_quantized(m, scheme.layout, tensors)
                     and not self._ignored(m)}
            if not found:
                raise UnsupportedCheckpointError(
                    f"quantization_config quant_method={self.method!r} but no tensor of the checkpoint is "
                    f"stored quantized")
            return found
        linear = sorted(m for m in modules if _is_linear(m, tensors))
        plan: dict[str, Scheme] = {}
        for targets, scheme in self.groups:
            matched = [m for m in linear if m not in plan and not self._ignored(m) and _matches(m, targets)]
            if not [m for m in linear if _matches(m, targets)]:
                raise UnsupportedCheckpointError(
                    f"quantization_config config_groups targets {targets} match no module of the checkpoint")
            plan.update((m, scheme) for m in matched)
        return plan

    def _ignored(self, module: str) -> bool:
        return _matches(module, self.ignore)


def _is_under(module: str, name: str) -> bool:
    """`name` is the module, a parent or a trailing part of it; a `*` matches one dotted part (gpt-oss's
    `model.layers.*.self_attn`)."""
    if "*" in name:
        return re.match(re.escape(name).replace(r"\*", r"[^.]+") + r"(\.|$)", module) is not None
    return module == name or module.startswith(name + ".") or module.endswith("." + name)


def _matches(module: str, targets: Iterable[str]) -> bool:
    """A compressed-tensors target: `re:` regex (matched from the start, as re.match), "Linear", or a name."""
    for target in targets:
        if target.startswith("re:"):
            if re.match(target[3:], module):
                return True
        elif target == "Linear" or _is_under(module, target):
            return True
    return False


def _is_linear(module: str, tensors: dict[str, TensorInfo]) -> bool:
    """A module holding a 2-D linear weight (dense or in a quantized layout), embeddings excepted."""
    if _NOT_LINEAR.search(module):
        return False
    weight = tensors.get(f"{module}.weight")
    return (weight is not None and len(weight.shape) == 2) or any(
        f"{module}.{suffix}" in tensors for suffix in ("weight_packed", "qweight"))


def _stores_quantized(module: str, layout: str, tensors: dict[str, TensorInfo]) -> bool:
    if layout in (GPTQ, AWQ):
        return f"{module}.qweight" in tensors
    if layout == MXFP4:
        return any(f"{module}.{proj}_blocks" in tensors for proj in MXFP4_PROJECTIONS)
    weight = tensors.get(f"{module}.weight")
    return weight is not None and weight.dtype.startswith("F8_")


def parse_quantization_config(config: dict) -> QuantConfig:
    """The checkpoint's `quantization_config`, every field checked; refusals name the field and value."""
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "fp8":
        return _fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "mxfp4":
        return _mxfp4(config)
    raise _refuse("quant_method", config.get("quant_method"), ", ".join(SUPPORTED_METHODS))


def _gptq(config: dict) -> QuantConfig:
    bits = _choice(config, "bits", (4, 8))
    fmt = _choice(config, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
    if config.get("dynamic"):
        raise _refuse("dynamic", config["dynamic"], "none (per-module overrides are not supported)")
    scheme = Scheme(GPTQ, bits=bits, group_size=_group_size("group_size", config.get("group_size", -1)),
                    symmetric=bool(config.get("sym", True)), gptq_v1_zeros=fmt == "gptq")
    return QuantConfig("gptq", [([], scheme)], [], by_targets=False)


def _awq(config: dict) -> QuantConfig:
    bits = config.get("bits", config.get("w_bit", 4))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    _choice(config, "version", ("gemm",), "gemm")
    if not config.get("zero_point", True):
        raise _refuse("zero_point", config["zero_point"], "true")
    group = _group_size("group_size", config.get("group_size", config.get("q_group_size", 128)))
    return QuantConfig("awq", [([], Scheme(AWQ, bits=4, group_size=group, symmetric=False))],
                       _names(config, "modules_to_not_convert"), by_targets=False)


def _fp8(config: dict) -> QuantConfig:
    _choice(config, "activation_scheme", ("dynamic", "static"), "dynamic")
    _choice(config, "fmt", ("e4m3",), "e4m3")
    block = config.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
                or block[1] % 32):
            raise _refuse("weight_block_size", block, "null or [rows, cols] with cols a multiple of 32")
        block = (block[0], block[1])
    return QuantConfig("fp8", [([], Scheme(FP8, block=block))],
                       _names(config, "ignored_layers", "modules_to_not_convert"), by_targets=False)


def _mxfp4(config: dict) -> QuantConfig:
    """gpt-oss's MoE experts in MXFP4 (vllmpy/loader/quantization/mxfp4.py); everything else dense."""
    for field in config:
        if field not in _MXFP4_FIELDS:
            raise _refuse(field, config[field], f"only the keys {', '.join(_MXFP4_FIELDS)}")
    return QuantConfig("mxfp4", [([], Scheme(MXFP4, bits=4, group_size=32))],
                       _names(config, "ignored_layers", "modules_to_not_convert"), by_targets=False)


def _compressed_tensors(config: dict) -> QuantConfig:
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if config.get(field):
            raise _refuse(field, config[field], "null")
    groups = config.get("config_groups") or {}
    if not groups:
        raise _refuse("config_groups", groups, "at least one group")
    parsed = []
    for name, group in groups.items():
        fmt = group.get("format") or config.get("format")
        if fmt not in _CT_FORMATS:
            raise _refuse(f"config_groups.{name}.format", fmt, ", ".join(_CT_FORMATS))
        targets = group.get("targets") or []
        if not targets:
            raise _refuse(f"config_groups.{name}.targets", targets, "a non-empty list")
        parsed.append((list(targets), _ct_scheme(f"config_groups.{name}", _CT_FORMATS[fmt], group)))
    return QuantConfig("compressed-tensors", parsed, _names(config, "ignore"), by_targets=True)


def _ct_scheme(prefix: str, layout: str, group: dict) -> Scheme:
    weights = group.get("weights") or {}
    kind = _choice(weights, "type", ("float",) if layout == FP8 else ("int",), "int")
    if weights.get("dynamic"):
        raise _refuse(f"{prefix}.weights.dynamic", weights["dynamic"], "false")
    acts = group.get("input_activations")
    if acts:
        _choice(acts, "num_bits", (8,))
        _choice(acts, "type", ("int", "float"))
    if kind == "float":
        _choice(weights, "num_bits", (8,))
        strategy = _choice(weights, "strategy", ("tensor", "channel", "block"))
        block = weights.get("block_structure") if strategy == "block" else None
        if block is not None and (len(block) != 2 or block[1] % 32):
            raise _refuse(f"{prefix}.weights.block_structure", block, "[rows, cols] with cols a multiple of 32")
        if not weights.get("symmetric", True):
            raise _refuse(f"{prefix}.weights.symmetric", False, "true for float weights")
        return Scheme(FP8, block=tuple(block) if block else None)
    bits = _choice(weights, "num_bits", (4, 8) if layout == PACKED else (8,))
    strategy = _choice(weights, "strategy", ("group", "channel") if layout == PACKED else ("group", "channel", "tensor"))
    size = -1
    if strategy == "group":
        if weights.get("group_size") is None:
            raise _refuse(f"{prefix}.weights.group_size", None, "a positive multiple of 32 for strategy group")
        size = _group_size(f"{prefix}.weights.group_size", weights["group_size"])
    _choice(weights, "actorder", (None, False, "group", "weight", "static", "dynamic"))
    return Scheme(layout, bits=bits, group_size=size, symmetric=bool(weights.get("symmetric", True)))
