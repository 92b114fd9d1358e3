"""Quantized KV caches: the rule by which rows become 8-bit codes and scales, and back.

:func:`fusedmha.flash_attn_with_kvcache` reads caches of int8, ``float8_e4m3fn`` or
``float8_e5m2`` codes with one float32 scale per row and head (``k_scale``/``v_scale``), and
quantizes the rows it appends by the rule below; :func:`quantize_kv` fills such a cache from a
prefill.
"""

from typing import Tuple

import torch
from torch import Tensor

# The dtypes a quantized cache may hold, and their largest codes.
LARGEST_CODE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_kv(x: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Rows of ``x`` ``(..., E)`` as 8-bit codes of ``dtype`` (int8, ``float8_e4m3fn`` or
    ``float8_e5m2``) and their float32 scales ``(...)``: ``scale = max|row| / qmax`` (qmax 127,
    448 or 57344; a row of zeros gets scale 0) and ``codes = x / scale`` rounded to the
    nearest (int8: halves to even, as :func:`torch.round`; fp8: the conversion's round to
    nearest even). A value is then ``codes * scale`` (:func:`dequantize_kv`). The op
    ``torch.ops.fusedmha.quantize_kv``; C++: ``fusedmha::quantize_kv``."""
    return torch.ops.fusedmha.quantize_kv(x, dtype)


def dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values ``codes * scale[..., None]`` of a quantized cache, in ``dtype`` (a float32
    product, as the kernels form it; float64 exactly): for tests and debugging, as the
    kernels never make this copy. C++: ``fusedmha::dequantize_kv``."""
    return torch.ops.fusedmha.dequantize_kv(codes, scale, dtype)
