"""RMSNorm variants, computed in fp32 as the reference implementations do."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.kernels import layer_kernels


def _rms_norm_kernel(x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor | None:
    """The C kernel's RMSNorm on CPU float32 or bfloat16 x (one call instead of seven torch ops; it rounds
    the mean of squares once, so it can differ from torch's float sum in the last bit), else None."""
    scale = norm.kernel_scale()
    w_bf16 = kernel_weight_flag(norm, scale, x)
    lib = layer_kernels() if w_bf16 is not None else None
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    rows, threads = x.numel() // dim, torch.get_num_threads()
    if x.dtype == torch.float32:
        lib.vq_rms_norm(x.data_ptr(), scale.data_ptr(), y.data_ptr(), rows, dim, norm.eps, threads)
    else:
        lib.vq_rms_norm_bf16(x.data_ptr(), scale.data_ptr(), w_bf16, y.data_ptr(), rows, dim, norm.eps, threads)
    return y


def kernel_weight_flag(norm: nn.Module, scale: torch.Tensor | None, x: torch.Tensor) -> int | None:
    """How the C kernels take `norm`'s scale on CPU x [.., dim]: 0 a float32 scale, 1 a bf16 one multiplying
    the normalized row rounded to bf16 (bf16 x: Llama's weight; Gemma's float32 1 + weight multiplies
    first); None where no kernel fits (another dtype or device, a scale that would promote the output)."""
    if (scale is None or x.device.type != "cpu" or not isinstance(norm, RMSNorm) or scale.dim() != 1
            or scale.shape[0] != x.shape[-1]):
        return None
    if x.dtype == torch.float32:
        return 0 if scale.dtype == torch.float32 else None
    if x.dtype != torch.bfloat16:
        return None
    if scale.dtype == torch.bfloat16:
        return 1
    return 0 if scale.dtype == torch.float32 and isinstance(norm, GemmaRMSNorm) else None


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32: the torch path both variants scale afterwards."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama-style: normalize in fp32, cast back, then scale by `weight`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def kernel_scale(self) -> torch.Tensor:
        """What the C kernels multiply the normalized row by (they take it only in float32); the fused paths
        (`add_norm`, rotary's q/k norm) read it instead of calling forward, so a subclass that changes the
        scale overrides this."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_kernel(x, self)
        if y is not None:
            return y
        return self.weight * _normalized(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: scale by (1 + weight) in fp32, then cast. The fp32 scale is computed once the
    weight is loaded (`finish_loading`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.register_buffer("scale", None, persistent=False)

    def finish_loading(self) -> None:
        self.scale = 1.0 + self.weight.float()

    def kernel_scale(self) -> torch.Tensor:
        scale = self.scale  # one lookup: a buffer is read through nn.Module.__getattr__ (~0.5 us)
        return scale if scale is not None else 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_kernel(x, self)
        if y is not None:
            return y
        return (_normalized(x, self.eps) * self.kernel_scale()).to(x.dtype)


def add_norm(x: torch.Tensor, branch: torch.Tensor, branch_norm: nn.Module,
             next_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + branch_norm(branch), next_norm of that): a sandwich layer's residual step. One C call for float32
    or bfloat16 RMSNorms on CPU at one eps and one scale dtype (at decode it replaces two or three ops of a
    few hundred floats each, mostly dispatch), bit-identical to the modules' kernels; else the modules.
    next_norm None: the second is None."""
    lib = layer_kernels()
    fused = (lib is not None and isinstance(branch_norm, RMSNorm) and x.dtype == branch.dtype
             and x.shape == branch.shape
             and (next_norm is None or isinstance(next_norm, RMSNorm) and next_norm.eps == branch_norm.eps))
    first = branch_norm.kernel_scale() if fused else None
    second = next_norm.kernel_scale() if fused and next_norm is not None else None
    w_bf16 = kernel_weight_flag(branch_norm, first, x) if fused else None
    if w_bf16 is None or next_norm is not None and kernel_weight_flag(next_norm, second, x) != w_bf16:
        x = x + branch_norm(branch)
        return x, None if next_norm is None else next_norm(x)
    x, branch = x.contiguous(), branch.contiguous()
    x_out = torch.empty_like(x)
    y = torch.empty_like(x) if second is not None else None
    dim = x.shape[-1]
    args = (None if y is None else y.data_ptr(), x.numel() // dim, dim, branch_norm.eps, torch.get_num_threads())
    second_ptr = None if y is None else second.data_ptr()
    if x.dtype == torch.float32:
        lib.vq_add_rms_norm(x.data_ptr(), branch.data_ptr(), first.data_ptr(), second_ptr, x_out.data_ptr(), *args)
    else:
        lib.vq_add_rms_norm_bf16(x.data_ptr(), branch.data_ptr(), first.data_ptr(), second_ptr, w_bf16,
                                 x_out.data_ptr(), *args)
    return x_out, y


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
