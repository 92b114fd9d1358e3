"""Trains a small causal transformer with data and context parallelism on CPU processes:

    torchrun --nproc-per-node 2 examples/python/train_context_parallel.py            # cp=2
    torchrun --nproc-per-node 4 examples/python/train_context_parallel.py --cp 2     # dp=2 x cp=2

The W processes form a dp x cp grid: consecutive groups of `cp` ranks share one batch of
sequences, each holding a zigzag shard of every sequence (fusedmha.distributed.shard), and run
self-attention over the whole sequence with ring attention (the model's attention modules made
context-parallel by fusedmha.distributed.context_parallel); the dp groups take different
batches. DistributedDataParallel over all W ranks averages the gradients; each rank's loss is
its tokens' summed loss over the global count of scored tokens, times W, so that average is
the gradient of the mean loss over every scored token of the global batch (the ranks score
different numbers of tokens: the first `lag` have nothing to copy).

The task needs attention across shards: predict the token `lag` positions back (a copy task),
with lag larger than a shard's chunks. Loss falls from ln(vocab) towards 0 as it learns.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fusedmha.distributed as cp


class CopyModel(nn.Module):
    def __init__(self, vocab, length, dim, heads, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(length, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, positions):
        x = self.embed(tokens) + self.position(positions)
        return self.head(self.encoder(x, is_causal=True, mask=causal_hint(tokens.size(1))))


def causal_hint(n):
    # nn.TransformerEncoder wants a mask with is_causal=True; the context-parallel attention
    # takes the hint and never reads it (its causal band is placed at global positions).
    return torch.zeros(n, n)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=0, help="context-parallel group size (default: all ranks)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--lag", type=int, default=100)
    p.add_argument("--batch", type=int, default=16, help="sequences per dp group")
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cp_size = a.cp or world
    assert world % cp_size == 0, f"--cp {cp_size} must divide the world size {world}"
    dp_rank = rank // cp_size
    # Every rank creates every group, in the same order (torch.distributed's rule).
    groups = [dist.new_group(list(range(d * cp_size, (d + 1) * cp_size)))
              for d in range(world // cp_size)]
    cp_group = groups[dp_rank]

    torch.manual_seed(0)  # the same initial weights everywhere
    model = CopyModel(a.vocab, a.length, a.dim, a.heads, a.layers)
    cp.context_parallel(model, group=cp_group, zigzag=True)
    model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    positions = cp.shard(torch.arange(a.length), seq_dim=0, group=cp_group, zigzag=True)
    data = torch.Generator().manual_seed(1000 + dp_rank)  # each dp group its own batches
    if rank == 0:
        print(f"{world} processes: dp={world // cp_size} x cp={cp_size}; sequences of "
              f"{a.length} tokens, {positions.numel()} per rank; chance loss "
              f"{math.log(a.vocab):.2f}")
    for step in range(1, a.steps + 1):
        tokens = torch.randint(a.vocab, (a.batch, a.length), generator=data)
        target = torch.full_like(tokens, -100)  # the first `lag` tokens have nothing to copy
        target[:, a.lag:] = tokens[:, :-a.lag]
        tokens, target = (cp.shard(t, seq_dim=1, group=cp_group, zigzag=True) for t in (tokens, target))
        logits = model(tokens, positions.expand_as(tokens))
        # DDP divides the summed gradients by W: scale by W over the global token count.
        scored = (target >= 0).sum().float()
        dist.all_reduce(scored)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                               reduction="sum") * (world / scored)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == a.steps:
            stats = torch.stack([loss.detach(), (logits.argmax(-1) == target).float().sum()])
            dist.all_reduce(stats)
            if rank == 0:
                print(f"step {step:4d}  loss {stats[0].item() / world:.3f}  "
                      f"copy accuracy {stats[1].item() / scored.item():.1%}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
