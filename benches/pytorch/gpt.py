"""PyTorch's eager training loop on the shakespeare example's default GPT, for the tokens per
second the fast path is measured against (issue 37). Not part of `cargo test` or CI: run it by
hand where PyTorch is installed (`pip install torch`):

    python3 benches/pytorch/gpt.py --threads 1 --batches 60
    python3 benches/pytorch/gpt.py --threads 2 --batches 60

The same architecture as `flashover_models::Gpt` with the example's defaults: characters of the
bundled corpus as tokens, learned position embeddings, 4 pre-LayerNorm blocks of width 128 with
4 heads and a 4x GELU MLP, a final LayerNorm, logits through the tied token embeddings; batches
of 32 random windows of 128 characters; AdamW (lr 3e-3, weight decay 0.01), cross-entropy over
every position. Prints one JSON line: tokens per second over the timed batches (the first
`--warmup` batches are not timed).
"""

import argparse
import gzip
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x, fused_attention):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        if fused_attention:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool).tril()
            y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, context, width, layers, heads):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, idx, fused_attention):
        x = self.tokens(idx) + self.positions[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, fused_attention)
        return self.norm(x) @ self.tokens.weight.t()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--naive-attention", action="store_true",
                   help="attention through matmul and softmax instead of scaled_dot_product_attention")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(42)
    root = os.path.join(os.path.dirname(__file__), "..", "..", "data", "shakespeare", "plays.txt.gz")
    text = gzip.open(root, "rb").read()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    model = Gpt(len(vocab), a.seq_len, a.width, a.layers, a.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    started = None
    for step in range(a.warmup + a.batches):
        if step == a.warmup:
            started = time.perf_counter()
        starts = torch.randint(0, len(data) - a.seq_len - 1, (a.batch_size,), generator=g)
        windows = torch.stack([data[s : s + a.seq_len + 1] for s in starts.tolist()])
        x, y = windows[:, :-1], windows[:, 1:]
        logits = model(x, not a.naive_attention)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - started
    tokens = a.batches * a.batch_size * a.seq_len
    print(json.dumps({
        "torch": torch.__version__, "threads": a.threads, "batches": a.batches,
        "tokens_per_second": tokens / seconds, "final_loss": loss.item(),
        "params": sum(p.numel() for p in model.parameters()),
        "attention": "naive" if a.naive_attention else "scaled_dot_product_attention",
    }))


if __name__ == "__main__":
    main()
