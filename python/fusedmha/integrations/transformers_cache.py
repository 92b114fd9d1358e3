"""A quantized KV cache for transformers' generate(), read in place by the "fusedmha" attention.

    from fusedmha.integrations.transformers import QuantizedKVCache
    model.set_attn_implementation("fusedmha")
    model.generate(**inputs, cache=QuantizedKVCache(dtype=torch.int8))  # (or past_key_values=)

Each layer keeps int8, float8_e4m3fn or float8_e5m2 codes with one float32 scale per row and
head (fusedmha.quantize_kv's rule), in FlashAttention's (batch, seq, heads, head_dim) layout,
grown by doubling. The attention reads the codes through fusedmha.flash_attn_with_kvcache: no
step dequantizes the cache (transformers' own quantized caches dequantize all of it each step).
What a layer's update returns stands for the codes and can only be read by the "fusedmha"
attention: any other attention implementation gets a clear error.
"""

from typing import Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import fusedmha

DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

# What the keys and values stand-ins answer (their shape, for models that read it); every
# other use is an error that names the fix.
_DESCRIBING = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
               torch.Tensor.ndim.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__repr__}


class QuantizedRows(torch.Tensor):
    """A quantized layer's keys or values as transformers passes them to the attention: the
    codes (batch, heads, seq, head_dim), and the layer that holds them with their scales."""

    layer: "QuantizedKVLayer"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _DESCRIBING:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(
            "fusedmha QuantizedKVCache holds quantized keys and values that only the 'fusedmha' "
            "attention reads; call model.set_attn_implementation('fusedmha') (or load the model "
            f"with attn_implementation='fusedmha') to use it (got {getattr(func, '__name__', func)})")


def _stand_in(codes: torch.Tensor, layer: "QuantizedKVLayer") -> QuantizedRows:
    with torch._C.DisableTorchFunctionSubclass():
        rows = torch.Tensor._make_subclass(QuantizedRows, codes)
    rows.layer = layer
    return rows


class QuantizedKVLayer(CacheLayerMixin):
    """One layer's quantized cache: codes (B, capacity, H_kv, E) of `dtype`, scales (B,
    capacity, H_kv) float32, the first `length` rows in use. The rows of the last update wait
    in `pending` for the attention, whose call appends them (quantized in place by the op,
    one call for the append and the attention); anything else that needs them writes them
    first (flush)."""

    is_sliding = False
    is_croppable = True

    def __init__(self, dtype: torch.dtype = torch.int8):
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"QuantizedKVCache: dtype must be one of {DTYPES}, got {dtype}")
        self.dtype, self.length, self.pending = dtype, 0, None
        self.k_codes = self.v_codes = self.k_scale = self.v_scale = None

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self._allocate(key_states.shape[0], 0, key_states.shape[1], key_states.shape[3],
                       value_states.shape[3])
        self.is_initialized = True

    def _allocate(self, B, capacity, H_kv, E, Ev):
        codes = dict(dtype=self.dtype, device=self.device)
        scales = dict(dtype=torch.float32, device=self.device)
        old = (self.k_codes, self.v_codes, self.k_scale, self.v_scale)
        self.k_codes, self.v_codes = torch.zeros(B, capacity, H_kv, E, **codes), torch.zeros(B, capacity, H_kv, Ev, **codes)
        self.k_scale, self.v_scale = torch.zeros(B, capacity, H_kv, **scales), torch.zeros(B, capacity, H_kv, **scales)
        if old[0] is not None:
            for new, kept in zip((self.k_codes, self.v_codes, self.k_scale, self.v_scale), old):
                new[:, :self.length] = kept[:, :self.length]

    def update(self, key_states, value_states, *args, **kwargs) -> Tuple[QuantizedRows, QuantizedRows]:
        """Takes the new rows (B, H_kv, L, E), to be appended by the attention's call;
        returns the stand-ins."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.flush()
        B, H_kv, L, E = key_states.shape
        end = self.length + L
        if end > self.k_codes.shape[1]:
            self._allocate(B, max(end, 2 * self.k_codes.shape[1], 256), H_kv, E, value_states.shape[3])
        self.pending = (key_states.transpose(1, 2), value_states.transpose(1, 2), self.length)
        self.length = end
        self.keys, self.values = (_stand_in(t[:, :end].transpose(1, 2), self)
                                  for t in (self.k_codes, self.v_codes))
        return self.keys, self.values

    def flush(self) -> None:
        """Writes the pending rows (quantize_kv's rule, as the op's append)."""
        if self.pending is None:
            return
        (k, v, start), self.pending = self.pending, None
        end = start + k.shape[1]
        for codes, scale, rows in ((self.k_codes, self.k_scale, k), (self.v_codes, self.v_scale, v)):
            codes[:, start:end], scale[:, start:end] = fusedmha.quantize_kv(rows, self.dtype)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length, self.pending = 0, None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("QuantizedKVCache.crop takes a negative count of tokens to remove")
        self.flush()
        self.length = max(self.length + tokens_to_remove, 0)

    def _select(self, index) -> None:
        self.flush()
        if self.is_initialized:
            for name in ("k_codes", "v_codes", "k_scale", "v_scale"):
                setattr(self, name, getattr(self, name)[index].contiguous())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.k_codes.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)


class QuantizedKVCache(Cache):
    """A transformers Cache of quantized keys and values (int8, float8_e4m3fn or float8_e5m2
    codes and a float32 scale per row and head), read in place by attn_implementation=
    "fusedmha". Its memory per cached token and layer: 2 · H_kv · (E + 4) bytes (E + 4 for one
    code per element and the row's scale), against 2 · H_kv · E · 4 for float32."""

    def __init__(self, dtype: torch.dtype = torch.int8):
        QuantizedKVLayer(dtype)  # (checks dtype now, not at the first step)
        super().__init__(layer_class_to_replicate=lambda: QuantizedKVLayer(dtype))
        self.dtype = dtype


def attend_quantized(query: torch.Tensor, key: QuantizedRows, attention_mask: Optional[torch.Tensor],
                     dropout: float, scaling: Optional[float], is_causal: bool,
                     sliding_window: Optional[int], softcap: float, sinks: Optional[torch.Tensor]):
    """The "fusedmha" attention over a QuantizedKVLayer's codes: query (B, H, L, E), the new
    rows already appended (the last L of the layer's length); returns (B, L, H, Ev). A mask is
    honoured where it is causal with left padding (transformers' masks for batched
    generation); anything else is refused."""
    layer = key.layer
    if dropout:
        raise ValueError("fusedmha QuantizedKVCache is for inference: dropout must be 0")
    B, H, L, E = query.shape
    n = layer.length
    leftpad = None if attention_mask is None else _left_padding(attention_mask, B, L, n, is_causal)
    window = (sliding_window - 1, 0) if sliding_window is not None and is_causal else (-1, -1)
    # The pending rows appended by this call (quantized in place by the op), unless the left
    # padding reaches past the rows before them (a padded prefill): the op's append wants the
    # padding within the cache's old rows, so those are written first.
    if layer.pending is not None and leftpad is not None and int(leftpad.max()) > layer.pending[2]:
        layer.flush()
    (k, v, start), layer.pending = layer.pending or (None, None, n), None
    with torch.no_grad():
        return fusedmha.flash_attn_with_kvcache(
            query.transpose(1, 2), layer.k_codes, layer.v_codes, k, v, cache_seqlens=start,
            cache_leftpad=leftpad, softmax_scale=scaling, causal=is_causal or attention_mask is not None,
            window_size=window, softcap=softcap, sinks=sinks, k_scale=layer.k_scale,
            v_scale=layer.v_scale)


def _left_padding(mask, B, L, n, is_causal):
    """Each sequence's left padding, from a bool (B, 1 or H, L, n) mask that is bottom-right
    causal past it (else an error: the codes are read by a call that takes no dense mask)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (L, n):
        raise ValueError("fusedmha QuantizedKVCache: expected a bool (B, 1, L, S) attention mask "
                         f"(or none), got {mask.dtype} of shape {tuple(mask.shape)}")
    last = mask[:, 0, -1].expand(B, n)
    pad = (~last).long().cumprod(-1).sum(-1)  # leading keys the last query does not see
    j, i = torch.arange(n, device=mask.device), torch.arange(L, device=mask.device) + n - L
    expected = (j[None, None, :] >= pad[:, None, None]) & (j[None, None, :] <= i[None, :, None])
    if not bool((mask.expand(B, mask.shape[1], L, n) == expected[:, None]).all()):
        raise ValueError("fusedmha QuantizedKVCache supports causal attention with left padding "
                         "only; this model passed another attention mask")
    return pad.to(torch.int32)
