"""RMSNorm variants, computed in fp32 as the reference implementations do."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.kernels import layer_kernels


def _rms_norm_kernel(x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor | None:
    """The C kernel's RMSNorm on CPU float32 or bfloat16 x (one call instead of seven torch ops; it rounds
    the mean of squares once, so it can differ from torch's float sum in the last bit), else None."""
    operand = norm.kernel_operand(x)
    lib = layer_kernels() if operand is not None else None
    if lib is None:
        return None
    (scale, w_bf16), x = operand, x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    if w_bf16 is None:
        lib.vq_rms_norm(x.data_ptr(), scale.data_ptr(), y.data_ptr(), x.numel() // dim, dim, norm.eps,
                        torch.get_num_threads())
    else:
        lib.vq_rms_norm_bf16(x.data_ptr(), scale.data_ptr(), w_bf16, y.data_ptr(), x.numel() // dim, dim, norm.eps,
                             torch.get_num_threads())
    return y


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32: the torch path both variants scale afterwards."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama-style: normalize in fp32, cast back, then scale by `weight`."""

    # How the C kernels take the scale, by (x dtype, scale dtype): None the float32 kernel (float32 x and
    # scale), else the bf16 kernel's w_bf16: 1 a bf16 scale multiplying the normalized row rounded to bf16
    # (Llama's weight in a bf16 model). Pairs not listed (float16, a scale that would promote) keep torch.
    KERNEL_FLAGS: dict[tuple[torch.dtype, torch.dtype], int | None] = {
        (torch.float32, torch.float32): None, (torch.bfloat16, torch.bfloat16): 1}

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def kernel_scale(self) -> torch.Tensor:
        """What the C kernels multiply the normalized row by; the fused paths (`add_norm`, rotary's q/k norm)
        read it instead of calling forward, so a subclass that changes the scale overrides this."""
        return self.weight

    def kernel_operand(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None] | None:
        """(scale, w_bf16 per KERNEL_FLAGS) for the C kernels on CPU x [.., dim], or None where none fits."""
        scale = self.kernel_scale()
        key = (x.dtype, scale.dtype)
        if key not in self.KERNEL_FLAGS or not x.is_cpu or scale.dim() != 1 or scale.shape[0] != x.shape[-1]:
            return None
        return scale, self.KERNEL_FLAGS[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_kernel(x, self)
        if y is not None:
            return y
        return self.weight * _normalized(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: scale by (1 + weight) in fp32, then cast. The fp32 scale is computed once the
    weight is loaded (`finish_loading`)."""

    # bf16 x: the float32 1 + weight multiplies before the one rounding (w_bf16 0).
    KERNEL_FLAGS = {**RMSNorm.KERNEL_FLAGS, (torch.bfloat16, torch.float32): 0}

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.register_buffer("scale", None, persistent=False)

    def finish_loading(self) -> None:
        self.scale = 1.0 + self.weight.float()

    def kernel_scale(self) -> torch.Tensor:
        scale = self._buffers["scale"]  # not self.scale: nn.Module.__getattr__ costs ~0.6 us, ~6 reads a layer
        return scale if scale is not None else 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_kernel(x, self)
        if y is not None:
            return y
        return (_normalized(x, self.eps) * self.kernel_scale()).to(x.dtype)


def add_norm(x: torch.Tensor, branch: torch.Tensor, branch_norm: nn.Module | None,
             next_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + branch_norm(branch), next_norm of that): a layer's residual step -- a sandwich layer's post-norm,
    add and next pre-norm, or (branch_norm None) a pre-norm layer's add and next norm. One C call for float32
    or bfloat16 x with RMSNorms on CPU at one eps and one scale dtype (at decode it replaces two or three ops
    of a few hundred floats each, mostly dispatch, and leaves a decode step nothing but kernel calls:
    `layers/decode_replay.py`), bit-identical to the modules' kernels and torch's add; else the modules.
    next_norm None: the second is None."""
    norms = [norm for norm in (branch_norm, next_norm) if norm is not None]
    operands = [norm.kernel_operand(x) if isinstance(norm, RMSNorm) else None for norm in norms]
    fits = (x.dtype == branch.dtype and x.shape == branch.shape and x.is_cpu and x.dtype in _ADD_KERNEL_DTYPES
            and None not in operands and len({flag for _, flag in operands}) <= 1
            and len({norm.eps for norm in norms}) <= 1)
    lib = layer_kernels() if fits else None
    if lib is None:
        x = x + (branch if branch_norm is None else branch_norm(branch))
        return x, None if next_norm is None else next_norm(x)
    x, branch = x.contiguous(), branch.contiguous()
    x_out = torch.empty_like(x)
    y = None if next_norm is None else torch.empty_like(x)
    scales = [operand[0].data_ptr() for operand in operands]
    w_branch = None if branch_norm is None else scales[0]
    w_next = None if next_norm is None else scales[-1]
    dim = x.shape[-1]
    shape = (x.numel() // dim, dim, norms[0].eps if norms else 0.0, torch.get_num_threads())
    y_ptr = None if y is None else y.data_ptr()
    if x.dtype == torch.float32:
        lib.vq_add_rms_norm(x.data_ptr(), branch.data_ptr(), w_branch, w_next, x_out.data_ptr(), y_ptr, *shape)
    else:
        lib.vq_add_rms_norm_bf16(x.data_ptr(), branch.data_ptr(), w_branch, w_next,
                                 operands[0][1] if operands else 0, x_out.data_ptr(), y_ptr, *shape)
    return x_out, y


_ADD_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class LayerNorm(nn.Module):
    """Mean-centred norm in fp32: (x - mean) / std * weight (+ bias).

    `shape` (heads, head_dim) gives each head its own weight (Cohere and StableLM q/k norm);
    `bias=False` drops the shift (Cohere); `affine=False` has no parameters (some OPT checkpoints).
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, bias: bool = True, affine: bool = True) -> None:
        super().__init__()
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False) if affine else None
        self.bias = nn.Parameter(torch.empty(shape), requires_grad=False) if affine and bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, dim = x.dtype, x.shape[-1:]
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        if w is None or w.dim() == 1:
            return torch.nn.functional.layer_norm(x.float(), dim, w, b, self.eps).to(dtype)
        x = torch.nn.functional.layer_norm(x.float(), dim, eps=self.eps) * w
        return (x if b is None else x + b).to(dtype)


class PerHeadLayerNorm(LayerNorm):
    """LayerNorm with one weight row per head; StableLM checkpoints store row h as `norms.{h}.weight`."""

    def __init__(self, shape: tuple[int, int], eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__(shape, eps, bias)
        self.shard_offsets = {head: (head, 1) for head in range(shape[0])}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        target = param.data if shard_id is None else param.data[shard_id]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for head {shard_id}: parameter {tuple(target.shape)} "
                             f"vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)
