"""fusedmha.integrations.transformers.QuantizedKVCache: generate() with int8/fp8 caches read in
place by the "fusedmha" attention equals generation with a float cache holding the same
dequantized values; another attention implementation gets a clear error."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install .[transformers]")

import fusedmha  # noqa: E402
from fusedmha.integrations.transformers import QuantizedKVCache  # noqa: E402  (registers "fusedmha")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

CODES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def tiny_llama(impl="fusedmha"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM._from_config(config, attn_implementation=impl).eval()


class DequantizedLayer(DynamicLayer):
    """A float cache layer of the values a quantized one holds: each new row quantized by
    fusedmha.quantize_kv's rule and stored dequantized (transformers' own layout)."""

    dtype = torch.int8

    def update(self, key_states, value_states, *args, **kwargs):
        rows = [fusedmha.dequantize_kv(*fusedmha.quantize_kv(t, self.dtype)).to(t.dtype)
                for t in (key_states, value_states)]
        return super().update(*rows, *args, **kwargs)


def dequantized_cache(dtype):
    layer = type("Layer", (DequantizedLayer,), {"dtype": dtype})
    cache = DynamicCache()
    cache.layer_class_to_replicate = layer
    return cache


def step_logits(model, ids, mask, cache, steps):
    """Greedy generation's per-step logits."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                         cache=cache, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return torch.stack(out.logits), out.sequences


@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize("padded", [False, True])
def test_generate_reads_the_codes_as_their_dequantized_values(dtype, padded):
    """Per-step logits and tokens of generation through a QuantizedKVCache equal those through
    a float cache of the same dequantized rows (prefill, then one token a step; left padding
    as transformers builds its masks for batched generation)."""
    model = tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
        mask[2, :9] = 0
    ours, tokens = step_logits(model, ids, mask, QuantizedKVCache(dtype=dtype), 12)
    want, want_tokens = step_logits(model, ids, mask, dequantized_cache(dtype), 12)
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(tokens, want_tokens)


def test_the_cache_holds_codes_and_scales_not_floats():
    model = tiny_llama()
    cache = QuantizedKVCache(dtype=torch.int8)
    ids = torch.randint(1, 128, (2, 30))
    model.generate(ids, max_new_tokens=5, do_sample=False, cache=cache, pad_token_id=0)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 34 and layer.length == 34
    assert layer.k_codes.dtype == torch.int8 and layer.k_scale.dtype == torch.float32
    assert layer.k_codes.shape[1] >= 34 and layer.k_codes.shape[2:] == (2, 16)


def test_a_sliding_window_model_reads_the_window_from_the_codes():
    """Mistral's sliding window past its length: the window runs in the kernel over the codes,
    as over the dequantized float cache."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           sliding_window=8)
    model = MistralForCausalLM._from_config(config, attn_implementation="fusedmha").eval()
    ids = torch.randint(1, 128, (1, 12))
    ours, _ = step_logits(model, ids, None, QuantizedKVCache(dtype=torch.int8), 10)
    want, _ = step_logits(model, ids, None, dequantized_cache(torch.int8), 10)
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)


def test_another_attention_implementation_gets_a_clear_error():
    model = tiny_llama("sdpa")
    with pytest.raises(RuntimeError, match="only the 'fusedmha' attention reads"):
        model.generate(torch.randint(1, 128, (1, 8)), max_new_tokens=2,
                       cache=QuantizedKVCache(dtype=torch.int8), pad_token_id=0)


def test_a_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of"):
        QuantizedKVCache(dtype=torch.float16)
