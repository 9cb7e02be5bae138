"""Checks and ctypes views of torch tensors handed to libstrata (CPU, contiguous,
known dtype)."""

import torch

from strata import _lib

DTYPES = {
    torch.float32: _lib.DTYPE_F32,
    torch.float16: _lib.DTYPE_F16,
    torch.bfloat16: _lib.DTYPE_BF16,
}


def check_cpu_contiguous(what, t):
    """ValueError unless t is a dense, contiguous tensor on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{what} is on device {t.device}; strata runs on the CPU: pass CPU tensors "
            "(e.g. fp32 master weights kept in host memory)")
    if t.layout != torch.strided:
        raise ValueError(f"{what} has layout {t.layout}; only dense (strided) tensors are "
                         "supported")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous (shape {tuple(t.shape)}, stride "
                         f"{t.stride()}); call .contiguous() on it first")


def dtype_code(what, t, allowed):
    """The strata_dtype of t; TypeError when t.dtype is not in allowed."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{what} has dtype {str(t.dtype).replace('torch.', '')}; "
                        f"strata supports {names} here")
    return DTYPES[t.dtype]
