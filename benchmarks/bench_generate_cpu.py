"""Generation with Hugging Face transformers on CPU: a small random Llama (hidden 512, 8
layers, 8 heads of 64, GQA 4:1) generating tokens greedily after a long prompt, with
attn_implementation "fusedmha" against "sdpa" (PyTorch's SDPA), runs alternated in one
process (median of --repeats). Prints the whole call's time and the decode rate: tokens/s of
the new tokens, (time of N tokens - time of 1 token) / (N - 1). Then, with timers around
each backend's attention function, the share of the generate call spent in attention, and
the most any attention kernel could speed the call up (Amdahl: if attention took no time).

    python benchmarks/bench_generate_cpu.py [--quick] [--prompt 2048] [--new 128]
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fusedmha  # noqa: E402
import fusedmha.integrations.transformers  # noqa: E402,F401  (registers "fusedmha")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402


def model_for(impl, prompt, new, layers):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=prompt + new + 16)
    return LlamaForCausalLM._from_config(config, attn_implementation=impl).eval()


def generate_seconds(model, ids, new):
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return time.perf_counter() - t, out


def attention_seconds(impl, model, ids, new):
    """(generate seconds, seconds inside the attention function) of one call, the attention
    function of `impl` wrapped with a timer for the call's duration."""
    inner = ALL_ATTENTION_FUNCTIONS[impl]
    spent = [0.0, 0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += 1

    ALL_ATTENTION_FUNCTIONS[impl] = timed
    try:
        seconds, _ = generate_seconds(model, ids, new)
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = inner
    return seconds, spent[0], spent[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    a = p.parse_args()
    if a.quick:
        a.prompt, a.new, a.layers, a.repeats = 64, 8, 2, 1
    print(f"threads={torch.get_num_threads()} isa={fusedmha.build_info()['cpu_isa_in_use']} "
          f"torch={torch.__version__} Llama hidden 512, {a.layers} layers, 8 heads / 2 K/V heads, "
          f"prompt {a.prompt}, {a.new} new tokens, greedy, float32")
    models = {impl: model_for(impl, a.prompt, a.new, a.layers) for impl in ("fusedmha", "sdpa")}
    ids = torch.randint(0, 32000, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    whole = {impl: [] for impl in models}
    first = {impl: [] for impl in models}
    tokens = {}
    for _ in range(a.repeats):
        for impl, model in models.items():  # alternated: a slow spell hits both
            seconds, out = generate_seconds(model, ids, a.new)
            whole[impl].append(seconds)
            tokens[impl] = out
            first[impl].append(generate_seconds(model, ids, 1)[0])
    same = torch.equal(tokens["fusedmha"], tokens["sdpa"])
    rates = {}
    header = f"{'impl':>9s} {'generate s':>11s} {'1 token s':>10s} {'decode tok/s':>13s}"
    print(header)
    print("-" * len(header))
    for impl in models:
        w, f = statistics.median(whole[impl]), statistics.median(first[impl])
        rates[impl] = (a.new - 1) / max(w - f, 1e-9)
        print(f"{impl:>9s} {w:11.2f} {f:10.2f} {rates[impl]:13.1f}")
    print(f"fusedmha vs sdpa: whole call {statistics.median(whole['sdpa']) / statistics.median(whole['fusedmha']):.2f}x, "
          f"decode {rates['fusedmha'] / rates['sdpa']:.2f}x; same tokens: {same}")
    print("\nattention's share of one generate call (timers around the attention function):")
    for impl, model in models.items():
        seconds, inside, calls = attention_seconds(impl, model, ids, a.new)
        print(f"{impl:>9s}: {inside:.3f} s of {seconds:.2f} s in {calls} calls "
              f"({100 * inside / seconds:.1f}%, {1e6 * inside / max(calls, 1):.0f} us per call); "
              f"an attention taking no time would make the call at most "
              f"{seconds / (seconds - inside):.2f}x faster")


if __name__ == "__main__":
    main()
