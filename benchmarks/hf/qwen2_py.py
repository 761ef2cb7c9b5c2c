"""Qwen2 in plain Python PyTorch, written the way Hugging Face's eager modeling_qwen2 runs it,
for the Python side of decode_compare.py and grpo_update_compare.py.

Modules and parameter names are Hugging Face's (model.layers.0.self_attn.q_proj.weight, ...):
Linear q/k/v with biases, o_proj without, RMSNorm in float32, RoPE (rotate_half, cos/sin from
the positions in float32), grouped-query attention by repeat_kv (as Hugging Face's eager
attention), matmul + softmax(float32) + matmul, SwiGLU, tied LM head. The KV cache is
preallocated and written in place (Hugging Face's StaticCache; its default DynamicCache
concatenates instead). `check()` compares this model with the independent implementation of
tests/fixtures/hf/hf_reference.py.
"""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

QWEN25_05B = dict(vocab=151936, hidden=896, inter=4864, heads=14, kv_heads=2, head_dim=64, theta=1e6, eps=1e-6)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep):
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.kv, self.d = c["heads"], c["kv_heads"], c["head_dim"]
        self.q_proj = nn.Linear(c["hidden"], self.h * self.d, bias=True)
        self.k_proj = nn.Linear(c["hidden"], self.kv * self.d, bias=True)
        self.v_proj = nn.Linear(c["hidden"], self.kv * self.d, bias=True)
        self.o_proj = nn.Linear(self.h * self.d, c["hidden"], bias=False)

    def forward(self, x, cos, sin, bias, cache=None, start=0):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv, self.d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            cache[0][:, :, start:start + n] = k
            cache[1][:, :, start:start + n] = v
            k, v = cache[0][:, :, :start + n], cache[1][:, :, :start + n]
        g = self.h // self.kv
        k, v = repeat_kv(k, g), repeat_kv(v, g)
        w = torch.matmul(q, k.transpose(2, 3)) * (self.d ** -0.5) + bias
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(w, v).transpose(1, 2).reshape(b, n, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c["hidden"], c["inter"], bias=False)
        self.up_proj = nn.Linear(c["hidden"], c["inter"], bias=False)
        self.down_proj = nn.Linear(c["inter"], c["hidden"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c["hidden"], c["eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden"], c["eps"])

    def forward(self, x, cos, sin, bias, cache=None, start=0):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"], c["eps"])


class Qwen2(nn.Module):
    """Qwen2ForCausalLM with tied embeddings. Random weights as Hugging Face initialises them."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Backbone(c)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    continue
                if name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
        d = c["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (c["theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)),
                             persistent=False)

    def head_weight(self):
        return self.model.embed_tokens.weight

    def rope(self, positions, dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def bias(key_mask, start, n):
        """(B, 1, n, S) additive mask: real keys at or before the query, and the query itself."""
        s = key_mask.shape[1]
        qi = torch.arange(start, start + n).unsqueeze(1)
        kj = torch.arange(s).unsqueeze(0)
        allowed = ((kj <= qi).unsqueeze(0) & key_mask.bool().unsqueeze(1)) | (kj == qi).unsqueeze(0)
        return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")).unsqueeze(1)

    def hidden_states(self, ids, mask):
        pos = (mask.cumsum(1) - 1).clamp_min(0).long()
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(pos, x.dtype)
        bias = self.bias(mask, 0, ids.shape[1])
        for layer in self.model.layers:
            x = layer(x, cos, sin, bias)
        return self.model.norm(x)

    def forward(self, ids, mask):
        return F.linear(self.hidden_states(ids, mask), self.head_weight())

    def make_cache(self, b, capacity):
        c = self.c
        return {"len": 0, "count": torch.zeros(b), "mask": torch.zeros(b, capacity),
                "kv": [(torch.zeros(b, c["kv_heads"], capacity, c["head_dim"]),
                        torch.zeros(b, c["kv_heads"], capacity, c["head_dim"])) for _ in range(c["layers"])]}

    def forward_cached(self, ids, mask, cache, last_only=False):
        """Logits of the next n tokens (B, n, V) (last_only: of the last one, (B, 1, V)), appended to the cache."""
        start, n = cache["len"], ids.shape[1]
        cache["mask"][:, start:start + n] = mask
        pos = (cache["count"].unsqueeze(1) + mask.cumsum(1) - 1).clamp_min(0).long()
        cache["count"] += mask.sum(1)
        bias = self.bias(cache["mask"][:, :start + n], start, n)
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(pos, x.dtype)
        for layer, kv in zip(self.model.layers, cache["kv"]):
            x = layer(x, cos, sin, bias, kv, start)
        cache["len"] = start + n
        x = self.model.norm(x)
        return F.linear(x[:, -1:] if last_only else x, self.head_weight())


def check():
    """This model against tests/fixtures/hf/hf_reference.py (an independent implementation of
    Hugging Face's Qwen2 forward) on a small random Qwen2: full logits and the KV-cache path."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "tests", "fixtures", "hf"))
    import hf_reference
    torch.manual_seed(0)
    c = dict(vocab=96, hidden=64, inter=96, heads=4, kv_heads=2, head_dim=16, theta=1e6, eps=1e-6, layers=2)
    m = Qwen2(c)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # nonzero biases and norms
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
    ref = hf_reference.build(config, {k: v.detach().clone() for k, v in m.state_dict().items()})
    ids = torch.randint(0, 96, (3, 9))
    mask = torch.ones(3, 9)
    mask[0, :3] = 0
    with torch.no_grad():
        want = ref.logits(ids, mask)
        got = m(ids, mask)
        cache = m.make_cache(3, 9)
        inc = torch.cat([m.forward_cached(ids[:, :5], mask[:, :5], cache)] +
                        [m.forward_cached(ids[:, t:t + 1], mask[:, t:t + 1], cache) for t in range(5, 9)], 1)
    keep = mask.bool().unsqueeze(-1)
    d_full = ((got - want).abs() * keep).max().item()
    d_cache = ((inc - want).abs() * keep).max().item()
    assert d_full < 1e-5 and d_cache < 1e-5, (d_full, d_cache)
    return d_full, d_cache


if __name__ == "__main__":
    print("max |logit - hf_reference|: full %.2g, KV cache %.2g" % check())
