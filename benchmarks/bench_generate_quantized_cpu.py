"""Generation with quantized KV caches: a small random Llama (hidden 512, 8 layers, 8 heads of
64, GQA 4:1, as bench_generate_cpu.py) with attn_implementation "fusedmha", its cache float32
(transformers' DynamicCache), bfloat16 (the model in bfloat16) or quantized
(fusedmha.integrations.transformers.QuantizedKVCache: int8, e4m3, e5m2). Prints the decode
rate after a long prompt, (time of N tokens - time of 1) / (N - 1) as tokens/s, runs
alternated (median of --repeats); then, teacher-forced on the float32 cache's greedy tokens,
each quantized cache's per-step logits error (norm of the difference / norm) against the
float32 cache's and the share of steps whose greedy token agrees.

    python benchmarks/bench_generate_quantized_cpu.py [--quick] [--prompt 2048] [--new 64]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fusedmha.integrations.transformers import QuantizedKVCache  # noqa: E402  (registers "fusedmha")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

CACHES = {"float32": None, "bfloat16": None, "int8": torch.int8, "e4m3": torch.float8_e4m3fn,
          "e5m2": torch.float8_e5m2}


def model_for(dtype, positions, layers):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=positions)
    model = LlamaForCausalLM._from_config(config, attn_implementation="fusedmha").eval()
    return model.to(dtype)


def cache_for(name):
    return DynamicCache() if CACHES[name] is None else QuantizedKVCache(dtype=CACHES[name])


def generate_seconds(model, ids, name, new):
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0, cache=cache_for(name))
    return time.perf_counter() - t


def forced_logits(model, ids, tokens, cache):
    """Logits of the prompt's last position and of each forced token after it."""
    out, logits = model(ids, cache=cache, use_cache=True), []
    logits.append(out.logits[:, -1].double())
    for t in range(tokens.shape[1] - 1):
        out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].double())
    return torch.stack(logits, 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.prompt, a.new, a.layers, a.repeats = 64, 8, 2, 1
    models = {torch.float32: model_for(torch.float32, a.prompt + a.new + 16, a.layers),
              torch.bfloat16: model_for(torch.bfloat16, a.prompt + a.new + 16, a.layers)}
    torch.manual_seed(1)
    ids = torch.randint(0, 32000, (1, a.prompt))
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} Llama hidden 512, "
          f"{a.layers} layers, 8 heads / 2 KV heads of 64; prompt {a.prompt}, {a.new} new tokens")
    times = {name: ([], []) for name in CACHES}
    for _ in range(a.repeats):
        for name in CACHES:
            model = models[torch.bfloat16 if name == "bfloat16" else torch.float32]
            times[name][0].append(generate_seconds(model, ids, name, a.new))
            times[name][1].append(generate_seconds(model, ids, name, 1))
    header = f"{'cache':>9s} {'KV bytes/token':>15s} {'decode tok/s':>13s} {'x float32':>10s}"
    print(header)
    print("-" * len(header))
    per_token = {"float32": 4 * 64, "bfloat16": 2 * 64}  # (per head and K or V)
    rates = {}
    for name in CACHES:
        n, one = statistics.median(times[name][0]), statistics.median(times[name][1])
        rates[name] = (a.new - 1) / (n - one)
        nbytes = 2 * 2 * a.layers * per_token.get(name, 64 + 4)
        print(f"{name:>9s} {nbytes:15d} {rates[name]:13.1f} {rates[name] / rates['float32']:9.2f}x",
              flush=True)
    model = models[torch.float32]
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                                pad_token_id=0)[:, a.prompt:]
        want = forced_logits(model, ids, tokens, DynamicCache())
        print(f"\nteacher-forced on the float32 cache's {a.new} greedy tokens:")
        header = f"{'cache':>9s} {'logits error':>13s} {'tokens agree':>13s}"
        print(header)
        print("-" * len(header))
        for name in ("int8", "e4m3", "e5m2"):
            got = forced_logits(model, ids, tokens, cache_for(name))
            error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).median().item()
            agree = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
            print(f"{name:>9s} {error:13.2e} {100 * agree:12.1f}%", flush=True)


if __name__ == "__main__":
    main()
