"""bitsandbytes' 4-bit blockwise quantization (NF4, FP4, double quantization), re-derived from
its published source, as the reference of Strata's models/ops/quantize_4bit.h.

Written from reading bitsandbytes (github.com/bitsandbytes-foundation/bitsandbytes): the CUDA
kernels of csrc/kernels.cu (kQuantizeBlockwiseSmall, the blocksize-64 4-bit launch of
csrc/ops.cu quantizeBlockwise; kQuantizeBlockwise's General8bit path for the nested absmax;
dQuantizeNF4, dQuantizeFP4, dQuantize, kDequantizeBlockwise, dDequantizeNF4,
dDequantizeFP4Tree) and bitsandbytes/functional.py (quantize_4bit, dequantize_4bit,
quantize_blockwise, dequantize_blockwise, get_4bit_type, create_dynamic_map). bitsandbytes
itself is not installed and not used. The arithmetic is numpy float32 (IEEE, one rounding per
operation, no fused multiply-add), element for element what the kernels compute:

- A tensor of n values (row-major) is cut into blocks of 64; a partial last block is padded
  with zeros, as the kernel's load fills the missing items with 0 (they take part in the
  absmax and, for odd n, the padding value's code is the low nibble of the last byte).
- absmax = max over the block of |x| (fmaxf from -FLT_MAX, so NaN is ignored); the scale is
  the fp32 reciprocal 1.0f / absmax and each value is normalized by a MULTIPLICATION with it
  (an all-zero block: 1/0 = inf, 0 * inf = NaN, which every decision tree sends to code 0).
- The code of a normalized value: NF4 and FP4 by bitsandbytes' decision trees of midpoints
  (not a nearest search; the thresholds are its fp32 literals, each decimal rounded once to fp32
  as the compiler rounds it: f32_literal), the 8-bit nested absmax by dQuantize's binary search
  over the 256-entry map and its choice between the neighbours.
- bitsandbytes builds its CUDA code with --use_fast_math, so the kernels' fp32 operations
  flush subnormal inputs and results to zero (-ftz=true); `_ftz` applies that where the kernels
  compute. Its `1.0f / absmax` also becomes the approximate reciprocal rcp.approx.ftz.f32 (at
  most 1 ulp from the rounded quotient); this reference, like Strata, uses the correctly rounded
  quotient, so a value within about one ulp of a decision threshold can get the neighbouring
  code from a bitsandbytes CUDA run.
- Two codes per byte, the first value of a pair in the high nibble.
- Double quantization (compress_statistics=True): offset = absmax.mean(), and absmax - offset
  quantized with quantize_blockwise(blocksize=256) to create_dynamic_map(signed=True). torch's
  float32 mean on CUDA sums in an order that cannot be reproduced; here (and in Strata) the mean
  is the fp32 absmax values summed in index order in float64, divided by the count in float64,
  rounded once to fp32.
- Dequantization: nested absmax = map[q] * nested_absmax (kDequantizeBlockwise, flushed), then
  `+= offset` (a torch fp32 add, not flushed); value = table[code] * absmax (flushed), rounded
  once to the output dtype. The FP4 kernel table (dDequantizeFP4Tree) gives code 8 the value
  -0.0, where the stored quant_map (get_4bit_type('fp4')) has +0.0.

API (used by test_quantize_4bit.py and by tests of `strata quantize` directories):

    q = quantize_4bit(x, quant_type="nf4", double_quant=True)   # x: 1-D float32 tensor/array
    y = dequantize_4bit(q, dtype=torch.bfloat16)                 # n values of dtype
    create_dynamic_map(), get_4bit_type("nf4" | "fp4")           # float32 tensors

quantize_4bit returns a dict of what bitsandbytes keeps for the tensor, under the names of its
QuantState.as_dict: "weight" (uint8, shape ((n + 1) // 2, 1): Params4bit's packed data),
"absmax" (float32 (blocks,), or uint8 (blocks,) with double quantization), "quant_map"
(float32 (16,)), "quant_type", "blocksize" (64), "shape" ((n,)), and with double quantization
"nested_absmax" (float32 (nested_blocks,)), "nested_quant_map" (float32 (256,)),
"nested_blocksize" (256) and "nested_offset" (a Python float, exactly the fp32 offset).
"""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import torch

BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256

F32 = np.float32
_TINY = F32(np.finfo(np.float32).tiny)  # FLT_MIN: smaller magnitudes are subnormal
_NEG_FLT_MAX = F32(-np.finfo(np.float32).max)


# The NF4 values as bitsandbytes writes them, in get_4bit_type's list (Python floats) and in
# csrc/kernels.cu's nf4_dequantization_lut (fp32 literals).
_NF4_DECIMALS = ("-1.0", "-0.6961928009986877", "-0.5250730514526367", "-0.39491748809814453",
                 "-0.28444138169288635", "-0.18477343022823334", "-0.09105003625154495", "0.0",
                 "0.07958029955625534", "0.16093020141124725", "0.24611230194568634",
                 "0.33791524171829224", "0.44070982933044434", "0.5626170039176941",
                 "0.7229568362236023", "1.0")


def get_4bit_type(quant_type):
    """The 16-entry quant_map bitsandbytes stores (functional.get_4bit_type), float32."""
    if quant_type == "nf4":
        data = [float(t) for t in _NF4_DECIMALS]
    elif quant_type == "fp4":
        # bit patterns s e e m with bias 2 (0b001 the subnormal 0.0625); -0 is the int 0.
        data = [0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
                -0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]
    else:
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    t = torch.tensor(data, dtype=torch.float32)
    return t / t.abs().max()


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes' dynamic map (functional.create_dynamic_map), float32, ascending."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        if signed:
            fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        else:
            fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)  # the loop's last i, as bitsandbytes has it
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data += [0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


# The FP4 magnitudes of csrc/kernels.cu's dequantization table (fp32 literals), index = the
# code's three low bits; the high bit is the sign.
_FP4_KERNEL_LITERALS = ("0.0", "0.005208333333", "0.66666667", "1.0", "0.33333333", "0.5",
                        "0.16666667", "0.25")


def kernel_table(quant_type):
    """What the CUDA dequantization multiplies absmax by, per code (float32 (16,))."""
    if quant_type == "nf4":
        return np.array([f32_literal(t) for t in _NF4_DECIMALS], dtype=F32)
    magnitudes = np.array([f32_literal(t) for t in _FP4_KERNEL_LITERALS], dtype=F32)
    codes = np.arange(16)
    sign = F32(1.0) - F32(2.0) * ((codes & 8) >> 3).astype(F32)  # +-1.0
    return (magnitudes[codes & 7] * sign).astype(F32)


def _ftz(a):
    """Subnormal float32 values to zero of the same sign (fast-math's flush)."""
    a = np.asarray(a, dtype=F32)
    return np.where(np.abs(a) < _TINY, np.copysign(F32(0), a), a).astype(F32)


def f32_literal(text):
    """The value of the C literal `<text>f`: the decimal rounded ONCE to fp32 (to nearest, ties to
    even), as nvcc and the host compilers convert it. float32(float(text)) rounds twice and,
    for four of dQuantizeNF4's thresholds (decimals of exact fp32 midpoints), lands one ulp off."""
    exact = Fraction(Decimal(text))
    near = F32(float(exact))
    candidates = (np.nextafter(near, F32(-np.inf), dtype=F32), near,
                  np.nextafter(near, F32(np.inf), dtype=F32))

    def distance_then_odd(c):
        return abs(Fraction(float(c)) - exact), int(np.array(c).view(np.uint32)) & 1
    return min(candidates, key=distance_then_odd)


def _t(text):
    return f32_literal(text)


def _nf4_codes(x):
    """dQuantizeNF4's tree, element-wise (NaN fails every test: code 0)."""
    x = np.asarray(x, dtype=F32)
    w = np.where
    hi = w(x > _t("0.3893125355243683"),
           w(x > _t("0.6427869200706482"),
             w(x > _t("0.8614784181118011"), 0b1111, 0b1110),
             w(x > _t("0.5016634166240692"), 0b1101, 0b1100)),
           w(x > _t("0.2035212516784668"),
             w(x > _t("0.2920137718319893"), 0b1011, 0b1010),
             w(x > _t("0.1202552504837513"), 0b1001, 0b1000)))
    lo = w(x > _t("-0.33967943489551544"),
           w(x > _t("-0.13791173323988914"),
             w(x > _t("-0.045525018125772476"), 0b0111, 0b0110),
             w(x > _t("-0.23460740596055984"), 0b0101, 0b0100)),
           w(x > _t("-0.6106329262256622"),
             w(x > _t("-0.4599952697753906"), 0b0011, 0b0010),
             w(x > _t("-0.8480964004993439"), 0b0001, 0b0000)))
    return w(x > _t("0.03979014977812767"), hi, lo).astype(np.uint8)


def _fp4_codes(x):
    """dQuantizeFP4's tree on |x|, with the sign bit 0b1000 for x < 0."""
    x = np.asarray(x, dtype=F32)
    sign = np.where(x < F32(0), 0b1000, 0)
    a = np.abs(x)
    w = np.where
    mag = w(a > _t("0.29166667"),
            w(a > _t("0.583333"),
              w(a > _t("0.8333333"), 0b0011, 0b0010),
              w(a > _t("0.4166667"), 0b0101, 0b0100)),
            w(a > _t("0.0859375"),
              w(a > _t("0.20833333"), 0b0111, 0b0110),
              w(a > _t("0.00260417"), 0b0001, 0b0000)))
    return (mag + sign).astype(np.uint8)


def _dynamic_codes(x, code):
    """dQuantize<0>: the binary search over the ascending 256-entry code from pivot 127 and the
    choice between the last value and its bracketing neighbour at their fp32 midpoint."""
    x = np.asarray(x, dtype=F32)
    pivot = np.full(x.shape, 127, dtype=np.int64)
    upper_pivot = np.full(x.shape, 255, dtype=np.int64)
    lower_pivot = np.zeros(x.shape, dtype=np.int64)
    lower = np.full(x.shape, F32(-1.0), dtype=F32)
    upper = np.full(x.shape, F32(1.0), dtype=F32)
    val = code[pivot]
    step = 64
    while step > 0:
        up = x > val
        lower_pivot = np.where(up, pivot, lower_pivot)
        lower = np.where(up, val, lower)
        upper_pivot = np.where(up, upper_pivot, pivot)
        upper = np.where(up, upper, val)
        pivot = np.where(up, pivot + step, pivot - step)
        val = code[pivot]
        step >>= 1
    upper = np.where(upper_pivot == 255, code[255], upper)
    lower = np.where(lower_pivot == 0, code[0], lower)
    up = x > val
    mid_up = _ftz((upper + val) * F32(0.5))
    mid_lo = _ftz((lower + val) * F32(0.5))
    q = np.where(up, np.where(x > mid_up, upper_pivot, pivot),
                 np.where(x < mid_lo, lower_pivot, pivot))
    return q.astype(np.uint8)


def _blockwise(values, blocksize):
    """values zero-padded to whole blocks, (blocks, blocksize) float32, and its absmax and
    normalized values as kQuantizeBlockwise computes them (with the fast-math flush)."""
    n = values.size
    blocks = -(-n // blocksize)
    padded = np.zeros(blocks * blocksize, dtype=F32)
    padded[:n] = values
    padded = padded.reshape(blocks, blocksize)
    absmax = np.fmax.reduce(_ftz(np.abs(padded)), axis=1, initial=_NEG_FLT_MAX).astype(F32)
    scale = _ftz(F32(1.0) / absmax)
    normalized = _ftz(_ftz(padded) * scale[:, None])
    return absmax, normalized


def absmax_mean(absmax):
    """The double-quantization offset: the fp32 values summed in index order in float64,
    divided by their count in float64, rounded once to fp32 (see the module docstring)."""
    a = np.asarray(absmax, dtype=np.float64)
    return F32(np.cumsum(a)[-1] / a.size)


def quantize_4bit(x, quant_type="nf4", double_quant=True):
    """bitsandbytes' functional.quantize_4bit(x, blocksize=64, compress_statistics=double_quant,
    quant_type=quant_type) of a 1-D float32 tensor or array; the dict of the module docstring."""
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x, dtype=F32).reshape(-1)
    n = x.size
    if n < 1:
        raise ValueError("quantize_4bit needs at least one value")
    with np.errstate(all="ignore"):
        absmax, normalized = _blockwise(x, BLOCKSIZE)
        to_code = _nf4_codes if quant_type == "nf4" else _fp4_codes
        codes = to_code(normalized).reshape(-1)[: 2 * ((n + 1) // 2)]
        packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
        out = {
            "weight": torch.from_numpy(packed.reshape(-1, 1).copy()),
            "quant_map": get_4bit_type(quant_type),
            "quant_type": quant_type,
            "blocksize": BLOCKSIZE,
            "shape": (n,),
        }
        if not double_quant:
            out["absmax"] = torch.from_numpy(absmax.copy())
            return out
        offset = absmax_mean(absmax)
        centred = (absmax - offset).astype(F32)
        code = create_dynamic_map().numpy()
        nested_absmax, nested_normalized = _blockwise(centred, NESTED_BLOCKSIZE)
        q = _dynamic_codes(nested_normalized, code).reshape(-1)[: absmax.size]
    out["absmax"] = torch.from_numpy(q.copy())
    out["nested_absmax"] = torch.from_numpy(nested_absmax.copy())
    out["nested_quant_map"] = torch.from_numpy(code.copy())
    out["nested_blocksize"] = NESTED_BLOCKSIZE
    out["nested_offset"] = float(offset)
    return out


def dequantize_absmax(q):
    """The fp32 absmax per block that dequantize_4bit multiplies by (float32 numpy (blocks,))."""
    absmax = q["absmax"].numpy()
    if "nested_absmax" not in q:
        return absmax.astype(F32)
    code = q["nested_quant_map"].numpy().astype(F32)
    nested = q["nested_absmax"].numpy().astype(F32)
    blocks = np.arange(absmax.size) // q.get("nested_blocksize", NESTED_BLOCKSIZE)
    with np.errstate(all="ignore"):
        scaled = _ftz(code[absmax.astype(np.int64)] * _ftz(nested[blocks]))
        return (scaled + F32(q["nested_offset"])).astype(F32)


def dequantize_4bit(q, dtype=torch.float32):
    """bitsandbytes' functional.dequantize_4bit of quantize_4bit's dict: the n values in dtype
    (a torch tensor of shape (n,)): fp32 products rounded once to dtype."""
    n = q["shape"][0]
    packed = q["weight"].numpy().reshape(-1)
    codes = np.empty(2 * packed.size, dtype=np.uint8)
    codes[0::2] = packed >> 4
    codes[1::2] = packed & 0x0F
    codes = codes[:n]
    table = kernel_table(q["quant_type"])
    absmax = dequantize_absmax(q)
    with np.errstate(all="ignore"):
        values = _ftz(table[codes] * _ftz(absmax[np.arange(n) // q["blocksize"]]))
    return torch.from_numpy(values.astype(F32)).to(dtype)
