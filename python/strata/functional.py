"""Gradient passes of libstrata on torch CPU tensors: statistics of a gradient
bucket (sum of squares in fp64, inf/nan flag), gradient accumulation of 16-bit
gradients into fp32, and fp32 <-> fp16/bf16 conversion (round to nearest even, NaN
kept). Tensors must be contiguous CPU tensors; nothing is allocated except the
outputs these functions return."""

import collections
import ctypes
import math

import torch

from strata import _lib
from strata._tensors import check_cpu_contiguous, dtype_code

__all__ = ["GradStats", "accumulate_grad", "grad_stats", "to_f32", "from_f32"]

_ANY = (torch.float32, torch.bfloat16, torch.float16)

GradStats = collections.namedtuple("GradStats", ["sum_squares", "nonfinite", "num_elems"])
GradStats.__doc__ = """sum_squares: sum of (scale * g)^2 in fp64 (bit-identical for any
thread count); nonfinite: some element was inf or NaN; num_elems: elements covered.
The global norm of several buckets is math.sqrt(sum of their sum_squares)."""


def _stats(c):
    return GradStats(c.sum_squares, bool(c.nonfinite), c.num_elems)


def grad_stats(grad, scale=1.0):
    """GradStats of grad (fp32, bf16 or fp16), each element times scale first."""
    check_cpu_contiguous("grad", grad)
    code = dtype_code("grad", grad, _ANY)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    out = _lib.GradStats()
    _lib.check(_lib.lib().strata_grad_stats_compute(grad.data_ptr(), code, grad.numel(),
                                                    float(scale), ctypes.byref(out)))
    return _stats(out)


def accumulate_grad(accum, grad, overwrite=False, want_stats=False):
    """accum (fp32) = grad (overwrite) or accum + grad, in place, one fp32 rounding;
    returns the GradStats of the new accum when want_stats, else None."""
    check_cpu_contiguous("accum", accum)
    dtype_code("accum", accum, (torch.float32,))
    check_cpu_contiguous("grad", grad)
    code = dtype_code("grad", grad, _ANY)
    if grad.numel() != accum.numel():
        raise ValueError(f"grad has {grad.numel()} elements, accum {accum.numel()}")
    out = _lib.GradStats()
    _lib.check(_lib.lib().strata_grad_accumulate(
        ctypes.cast(accum.data_ptr(), ctypes.POINTER(ctypes.c_float)), grad.data_ptr(), code,
        accum.numel(), 1 if overwrite else 0, ctypes.byref(out) if want_stats else None))
    return _stats(out) if want_stats else None


def from_f32(src, dtype, out=None):
    """src (fp32) converted to dtype (torch.bfloat16, torch.float16 or torch.float32),
    into out when given (same shape, contiguous) else a new tensor."""
    check_cpu_contiguous("src", src)
    dtype_code("src", src, (torch.float32,))
    if out is None:
        out = torch.empty(src.shape, dtype=dtype)
    check_cpu_contiguous("out", out)
    code = dtype_code("out", out, _ANY)
    if out.dtype != dtype or out.numel() != src.numel():
        raise ValueError(f"out must be {dtype} with {src.numel()} elements")
    _lib.check(_lib.lib().strata_convert_from_f32(src.data_ptr(), out.data_ptr(), code,
                                                  src.numel()))
    return out


def to_f32(src, out=None):
    """src (bf16, fp16 or fp32) widened exactly to fp32, into out when given."""
    check_cpu_contiguous("src", src)
    code = dtype_code("src", src, _ANY)
    if out is None:
        out = torch.empty(src.shape, dtype=torch.float32)
    check_cpu_contiguous("out", out)
    dtype_code("out", out, (torch.float32,))
    if out.numel() != src.numel():
        raise ValueError(f"out has {out.numel()} elements, src {src.numel()}")
    _lib.check(_lib.lib().strata_convert_to_f32(src.data_ptr(), code, out.data_ptr(),
                                                src.numel()))
    return out
