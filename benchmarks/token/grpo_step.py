#!/usr/bin/env python3
"""The GRPO step of bench_token's BM_grpo_step, written in Python PyTorch, side by side.

Same model (GPT: vocab 14, d_model 64, 2 layers, 4 heads, pre-norm, learned positions, KV cache),
same batch (16 prompts of 6 tokens x group 8 = 128 samples, 5 new tokens at temperature 1), same
reward (share of generated tokens equal to 1), group-normalised advantages (unbiased std,
eps 1e-6), pi_old recomputed with the training forward, PPO clip 0.2 / 0.28, token-mean, AdamW
lr 1e-4, one thread on both sides. Prints samples/s; with --cpp PATH also runs PATH (bench_token):
BM_grpo_step_same_work (unirl doing this script's work: every prompt row through the model, a
separate pi_old forward) and BM_grpo_step (unirl's defaults: each prompt once per group in the
sampler and the update, pi_old from the single update's own forward — same loss and gradients),
and prints the ratios. The Python step is also timed taking pi_old from the update's forward (TRL's
shortcut with one update per step), the fairest Python baseline for unirl's defaults.

    python3 benchmarks/token/grpo_step.py --cpp build/benchmarks/token/bench_token
"""
import argparse
import json
import math
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, L, H, MAXLEN = 14, 64, 2, 4, 16
PROMPTS, GROUP, NEW = 16, 8, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x, bias, cache=None, start=0):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if cache is not None:
            cache[0][:, :, start:start + n] = k
            cache[1][:, :, start:start + n] = v
            k, v = cache[0][:, :, :start + n], cache[1][:, :, :start + n]
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D // H) + bias, -1)
        h = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, D))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(MAXLEN, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    @staticmethod
    def bias(key_mask, start, n):
        s = key_mask.shape[1]
        qi = torch.arange(start, start + n).unsqueeze(1)
        kj = torch.arange(s).unsqueeze(0)
        allowed = ((kj <= qi).unsqueeze(0) & key_mask.bool().unsqueeze(1)) | (kj == qi).unsqueeze(0)
        return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).unsqueeze(1)

    def forward(self, ids, mask):
        pos = (mask.cumsum(1) - 1).clamp_min(0).long()
        x = self.tok(ids) + self.pos(pos)
        bias = self.bias(mask, 0, ids.shape[1])
        for b in self.blocks:
            x = b(x, bias)
        return self.head(self.ln_f(x))

    def forward_cached(self, ids, mask, cache):
        start, n = cache["len"], ids.shape[1]
        cache["mask"][:, start:start + n] = mask
        pos = (cache["count"].unsqueeze(1) + mask.cumsum(1) - 1).clamp_min(0).long()
        cache["count"] += mask.sum(1)
        bias = self.bias(cache["mask"][:, :start + n], start, n)
        x = self.tok(ids) + self.pos(pos)
        for i, b in enumerate(self.blocks):
            x = b(x, bias, cache["kv"][i], start)
        cache["len"] = start + n
        return self.head(self.ln_f(x))


def grpo_step(model, opt, prompts, reuse_old=False):
    b, p = prompts.shape
    with torch.no_grad():
        cache = {"len": 0, "count": torch.zeros(b), "mask": torch.zeros(b, p + NEW),
                 "kv": [(torch.zeros(b, H, p + NEW, D // H), torch.zeros(b, H, p + NEW, D // H)) for _ in range(L)]}
        logits = model.forward_cached(prompts, torch.ones(b, p), cache)[:, -1]
        out = []
        for t in range(NEW):
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
            out.append(nxt)
            if t + 1 < NEW:
                logits = model.forward_cached(nxt, torch.ones(b, 1), cache)[:, 0]
        comp = torch.cat(out, 1)
        full = torch.cat([prompts, comp], 1)
        mask = torch.ones_like(full, dtype=torch.float)
        if not reuse_old:
            old = torch.log_softmax(model(full[:, :-1], mask[:, :-1])[:, p - 1:], -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        reward = (comp == 1).float().mean(1)
        g = reward.view(-1, GROUP)
        adv = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
        adv = torch.where(g.amax(1, keepdim=True) == g.amin(1, keepdim=True), torch.zeros_like(adv), adv).view(-1, 1)
    lsm = torch.log_softmax(model(full[:, :-1], mask[:, :-1])[:, p - 1:], -1)
    logp = lsm.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1).mean()
    if reuse_old:  # one update per step: pi_old is this forward (as TRL does with num_iterations = 1)
        old = logp.detach()
    ratio = torch.exp(logp - old)
    loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), entropy.item()


def python_samples_per_second(seconds, reuse_old=False):
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    prompts = torch.tensor([[i % 10, (i + 3) % 10, 10, (i * 7) % 10, i % 4, 11] for i in range(PROMPTS)])
    prompts = prompts.repeat_interleave(GROUP, 0)
    for _ in range(3):
        grpo_step(model, opt, prompts, reuse_old)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        grpo_step(model, opt, prompts, reuse_old)
        n += 1
    return n * PROMPTS * GROUP / (time.perf_counter() - t0)


def cpp_samples_per_second(path):
    """items_per_second of BM_grpo_step (unirl's defaults) and BM_grpo_step_same_work at this size."""
    out = subprocess.run([path, f"--benchmark_filter=BM_grpo_step.*/{D}/{L}/", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True).stdout
    return {b["name"].split("/")[0]: b["items_per_second"] for b in json.loads(out)["benchmarks"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpp", help="path of bench_token, to run the unirl side too")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (bench_token uses 1)")
    ap.add_argument("--d-model", type=int, default=64, choices=(64, 128), help="model width (bench_token: 64 or 128)")
    ap.add_argument("--layers", type=int, default=2, choices=(2, 4), help="layers (bench_token: 2 with 64, 4 with 128)")
    a = ap.parse_args()
    global D, L
    D, L = a.d_model, a.layers
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, d_model {D}, {L} layers")
    py = python_samples_per_second(a.seconds)
    py_reuse = python_samples_per_second(a.seconds, reuse_old=True)
    print(f"python  GRPO step:                       {py:9.1f} samples/s")
    print(f"python  GRPO step, pi_old from the update: {py_reuse:7.1f} samples/s")
    if a.cpp:
        cpp = cpp_samples_per_second(a.cpp)
        same, fast = cpp["BM_grpo_step_same_work"], cpp["BM_grpo_step"]
        print(f"unirl   GRPO step, the same work:        {same:9.1f} samples/s  ({same / py:.2f}x)")
        print(f"unirl   GRPO step, defaults:             {fast:9.1f} samples/s  ({fast / py:.2f}x the first, "
              f"{fast / py_reuse:.2f}x the second Python step)")
        print(f"ratio unirl / python: {fast / py:.2f}x")

if __name__ == "__main__":
    main()
