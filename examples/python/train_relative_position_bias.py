"""Trains a trainable attention bias: T5-style bucketed relative positions through the float
attn_mask of fusedmha.MultiheadAttention, step for step against torch.nn.MultiheadAttention.

    PYTHONPATH=python python3 examples/python/train_relative_position_bias.py
    PYTHONPATH=python python3 examples/python/train_relative_position_bias.py --dtype float64

The model has no position embeddings: token embeddings, then attention layers (no MLPs) whose
only position information is one learnt table, ``nn.Embedding(num_buckets, heads)``, looked
up by the bucket of each key's distance from its query. Distances below half the buckets get
a bucket each; the farther ones share log-spaced buckets up to --max-distance. The table gives
an (H, L, S) bias, with -inf on the keys after each query (causal), passed as the float
attn_mask; fusedmha returns its gradient, so the table trains like any other parameter.

The task is to output the token `lag` positions back. The tokens are random, so nothing but
relative position says which one to copy: the loss starts at ln(vocab) and falls towards 0
only as the bias table learns to point each query `lag` keys back.

The same model is trained twice from identical initial weights on identical batches, once with
fusedmha.MultiheadAttention and once with torch.nn.MultiheadAttention; the script prints both
losses and their difference as it goes, then the final losses, the largest difference between
the two learnt bias tables, the bucket each head's learnt bias favours, and each
implementation's training time.
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import fusedmha


def relative_position_bucket(relative_position, num_buckets, max_distance, bidirectional):
    """The bucket of each key-minus-query offset ``j - i``.

    Causal: only keys at or before the query matter; distance ``i - j`` (keys after the query
    share bucket 0, and the causal mask removes them). Bidirectional: half the buckets for
    keys before the query and half for keys after it. Within each half, small distances get
    exact buckets (they tell nearby tokens apart) and the others log-spaced ones, all
    distances from max_distance on in the last.
    """
    offset = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        offset = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # (clamped to `exact`: the log of the near distances is never used, and must not be -inf)
    scaled = torch.log(distance.clamp(min=exact).double() / exact) / math.log(max_distance / exact)
    far = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return offset + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """A learnt scalar per (bucket, head), spread into an (H, L, S) additive score bias."""

    def __init__(self, heads, num_buckets, max_distance, causal, dtype=None):
        super().__init__()
        self.num_buckets, self.max_distance, self.causal = num_buckets, max_distance, causal
        self.table = nn.Embedding(num_buckets, heads, dtype=dtype)
        # Zero: attention starts blind to position, so what the model learns about position
        # is all in what the table learns.
        nn.init.zeros_(self.table.weight)

    def forward(self, length):
        device = self.table.weight.device
        i = torch.arange(length, device=device)[:, None]
        j = torch.arange(length, device=device)[None, :]
        buckets = relative_position_bucket(j - i, self.num_buckets, self.max_distance,
                                           bidirectional=not self.causal)
        bias = self.table(buckets).permute(2, 0, 1)  # (L, S, H) -> (H, L, S)
        if self.causal:
            bias = bias.masked_fill(j > i, float("-inf"))
        return bias


class RelativeAttentionModel(nn.Module):
    """Embeddings, pre-norm residual attention layers sharing one relative-position bias (as
    T5's layers share the first layer's), and a linear read-out. ``attention`` is the
    nn.MultiheadAttention class to use (or fusedmha's drop-in one)."""

    def __init__(self, attention, vocab, dim, heads, layers, num_buckets, max_distance,
                 causal=True, dtype=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.bias = RelativePositionBias(heads, num_buckets, max_distance, causal, dtype=dtype)
        self.norms = nn.ModuleList(nn.LayerNorm(dim, dtype=dtype) for _ in range(layers))
        self.attns = nn.ModuleList(attention(dim, heads, batch_first=True, dtype=dtype)
                                   for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, dtype=dtype)

    def forward(self, tokens):
        n, length = tokens.shape
        # A 3-D attn_mask is (N*H, L, S), batch-major: entry n*H + h is batch n's head h. The
        # same (H, L, S) bias for every sequence is the bias repeated N times; autograd sums
        # the repeats back into the table's gradient.
        mask = self.bias(length).repeat(n, 1, 1)
        x = self.embed(tokens)
        for norm, attn in zip(self.norms, self.attns):
            h = norm(x)
            x = x + attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.head(self.final_norm(x))


def copy_batch(generator, batch, length, vocab, lag):
    """Random tokens; the target of position i is the token at i - lag (none for i < lag)."""
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    targets = torch.full_like(tokens, -100)
    targets[:, lag:] = tokens[:, :-lag]
    return tokens, targets


def train(steps=300, batch=32, length=64, vocab=16, lag=5, dim=64, heads=4, layers=2,
          num_buckets=16, max_distance=64, lr=1e-2, seed=0, dtype="float32", log_every=25,
          log=print):
    """Trains the model with each attention implementation, in lockstep on the same batches.
    Returns {"fusedmha" | "torch": {"losses": [float], "bias": (num_buckets, heads) table,
    "seconds": training time}}."""
    if not 0 < lag < length:
        raise ValueError(f"--lag must be in [1, --length): got lag {lag}, length {length}")
    if not 2 <= num_buckets // 2 < max_distance:
        raise ValueError("--num-buckets must be at least 4 and --max-distance above half of it")
    dtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    reference = RelativeAttentionModel(nn.MultiheadAttention, vocab, dim, heads, layers,
                                       num_buckets, max_distance, dtype=dtype)
    ours = RelativeAttentionModel(fusedmha.MultiheadAttention, vocab, dim, heads, layers,
                                  num_buckets, max_distance, dtype=dtype)
    ours.load_state_dict(reference.state_dict())  # (same keys: a drop-in module)
    runs = {"fusedmha": ours, "torch": reference}
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=lr) for name, model in runs.items()}
    results = {name: {"losses": [], "seconds": 0.0} for name in runs}
    data = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        tokens, targets = copy_batch(data, batch, length, vocab, lag)
        for name, model in runs.items():
            start = time.perf_counter()
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            results[name]["seconds"] += time.perf_counter() - start
            results[name]["losses"].append(loss.item())
        if log is not None and (step % log_every == 0 or step == 1):
            a, b = results["fusedmha"]["losses"][-1], results["torch"]["losses"][-1]
            log(f"step {step:5d}  fusedmha loss {a:.6f}  torch loss {b:.6f}  diff {a - b:+.2e}")
    for name, model in runs.items():
        results[name]["bias"] = model.bias.table.weight.detach().clone()
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--lag", type=int, default=5, help="copy the token this many positions back")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-buckets", type=int, default=16)
    p.add_argument("--max-distance", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    print(f"copy the token {args.lag} back: {args.steps} steps of {args.batch} x {args.length} "
          f"tokens (vocab {args.vocab}, ln(vocab) = {math.log(args.vocab):.3f}), dim {args.dim}, "
          f"{args.heads} heads, {args.layers} layers, {args.num_buckets} buckets, {args.dtype}")
    results = train(**vars(args))
    ours, ref = results["fusedmha"], results["torch"]
    print(f"final loss: fusedmha {ours['losses'][-1]:.6f}, torch {ref['losses'][-1]:.6f}")
    print(f"max |difference| of the learnt bias tables: "
          f"{(ours['bias'] - ref['bias']).abs().max().item():.2e}")
    lag_bucket = relative_position_bucket(torch.tensor(-args.lag), args.num_buckets,
                                          args.max_distance, bidirectional=False).item()
    print(f"bucket of each head's largest learnt bias: {ours['bias'].argmax(0).tolist()} "
          f"(distance {args.lag} is bucket {lag_bucket})")
    print(f"training time: fusedmha.MultiheadAttention {ours['seconds']:.2f} s, "
          f"torch.nn.MultiheadAttention {ref['seconds']:.2f} s")
    return results


if __name__ == "__main__":
    main()
