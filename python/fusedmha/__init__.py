"""fusedmha: fused multi-head attention for PyTorch (CPU and CUDA kernels).

    import fusedmha
    out = fusedmha.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
    mha = fusedmha.MultiheadAttention(embed_dim, num_heads, batch_first=True)  # nn.MultiheadAttention's contract
    out = fusedmha.flash_attn_func(q, k, v, causal=True, window_size=(4096, 0))  # flash_attn 2's API

Importing the package loads the native library, which registers the ops
under ``torch.ops.fusedmha``.
"""

import torch

from fusedmha._build_config import TORCH_VERSION as _BUILT_TORCH_VERSION
from fusedmha._build_config import VERSION as __version__


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


# A C++ extension only loads into the torch (major.minor) it was compiled
# against; say so plainly instead of failing on an undefined symbol.
if _major_minor(torch.__version__) != _major_minor(_BUILT_TORCH_VERSION):
    raise ImportError(
        f"fusedmha {__version__} was built against torch {_BUILT_TORCH_VERSION}, but torch "
        f"{torch.__version__} is installed. Rebuild it against this torch: "
        "pip install --no-build-isolation --force-reinstall --no-deps <path to fusedmha>"
    )

from fusedmha import _C  # noqa: E402  (loads libfusedmha: registers torch.ops.fusedmha)
from fusedmha.flash_attn import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    merge_attention,
)
from fusedmha.flex import flex_attention  # noqa: E402
from fusedmha.functional import scaled_dot_product_attention  # noqa: E402
from fusedmha.kv_quantization import dequantize_kv, quantize_kv  # noqa: E402
from fusedmha.modules import MultiheadAttention  # noqa: E402


def build_info() -> dict:
    """Version, torch version built against, CPU ISA levels compiled and in use, CUDA on/off."""
    return _C.build_info()


def cpu_fma_peak_gflops(seconds: float = 0.25) -> float:
    """The fp32 FMA peak of this machine in GFLOP/s: register-only FMA chains at the ISA level
    the CPU kernels run at, on every intra-op thread at once, the fastest of five rounds that
    take about `seconds` together (the benchmarks' yardstick)."""
    return _C.cpu_fma_peak_gflops(seconds)


__all__ = [
    "scaled_dot_product_attention",
    "MultiheadAttention",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "merge_attention",
    "flex_attention",
    "quantize_kv",
    "dequantize_kv",
    "build_info",
    "cpu_fma_peak_gflops",
    "__version__",
]
