#!/usr/bin/env python3
"""KV-cache decoding at Qwen2.5-0.5B's layer shapes: unirl (bench_hf) and Python PyTorch side by side.

Same model shapes (hidden 896, 14 heads / 2 KV heads of 64, MLP 4864, vocabulary 151,936, tied
embeddings, rope_theta 1e6; random weights, float32; --layers of them), same torch (run this
with Debian's python3-torch, the LibTorch bench_hf links), same threads, same work: prefill a
16-token prompt and two greedy steps (not timed), then --new greedy steps through a preallocated
KV cache (timed), at batch 1 and 64. Each side decodes --reps times per round on one model, and
the rounds alternate Python and unirl (--rounds), so both meet the same load from other jobs on a
shared machine; the fastest decode of each side counts. The Python side is qwen2_py.Qwen2 (Hugging Face's eager
forward; checked against tests/fixtures/hf/hf_reference.py first).

It also measures the machine in the same run: sgemm GFLOP/s of torch.mm at a decode shape
(64 x 896) @ (896 x 4864) and a large square one, and the read bandwidth (sum of a 1 GiB tensor,
and a 1 GiB copy), then puts each result against them: batch 64 as a share of the sgemm rate,
batch 1 against the bandwidth bound (every weight read once per token).

    python3 benchmarks/hf/decode_compare.py --cpp build/benchmarks/hf/bench_hf --layers 24
"""
import argparse
import json
import os
import subprocess
import time

import torch

import qwen2_py

PROMPT = 16


def best_time(f, reps, rounds=3):
    f()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def machine():
    """sgemm GFLOP/s (decode shape, square) and read / copy bandwidth GB/s, best of three rounds."""
    out = {}
    for name, (m, k, n), reps in (("sgemm_decode", (64, 896, 4864), 50), ("sgemm_square", (2048, 2048, 2048), 3)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        out[name] = 2 * m * k * n / best_time(lambda: torch.mm(a, b), reps) / 1e9
    x = torch.randn(256 * 1024 * 1024)  # 1 GiB
    out["read_GBps"] = x.numel() * 4 / best_time(lambda: x.sum(), 5) / 1e9
    y = torch.empty_like(x)
    out["copy_GBps"] = 2 * x.numel() * 4 / best_time(lambda: y.copy_(x), 5) / 1e9  # read + write
    return out


def model_figures(layers, batch, new):
    """FLOPs per generated token (matmuls + attention at the mean context) and bytes of weights read per step."""
    c = qwen2_py.QWEN25_05B
    h, i, v, d = c["hidden"], c["inter"], c["vocab"], c["head_dim"]
    q, kv = c["heads"] * d, c["kv_heads"] * d
    layer_macs = h * q + 2 * h * kv + q * h + 3 * h * i
    ctx = PROMPT + 2 + new / 2
    attn_macs = 2 * c["heads"] * d * ctx
    flops = 2 * (layers * (layer_macs + attn_macs) + h * v)
    layer_params = layer_macs + q + 2 * kv + 2 * h  # + biases and norms
    weight_bytes = 4 * (layers * layer_params + v * h + h)
    kv_bytes = 4 * layers * 2 * batch * kv * ctx
    return flops, weight_bytes + kv_bytes


def python_decode(layers, batches, new, reps):
    """tokens/s per batch size, the fastest of `reps` timed decodes on one model (as bench_hf --reps)."""
    torch.manual_seed(0)
    c = dict(qwen2_py.QWEN25_05B, layers=layers)
    m = qwen2_py.Qwen2(c).eval()
    out = {}
    for batch in batches:
        prompt = torch.randint(0, c["vocab"], (batch, PROMPT))
        one = torch.ones(batch, 1)
        best = float("inf")
        with torch.no_grad():
            for _ in range(reps):
                cache = m.make_cache(batch, PROMPT + 2 + new)
                nxt = m.forward_cached(prompt, torch.ones(batch, PROMPT), cache, last_only=True)[:, -1].argmax(-1, True)
                for _ in range(2):
                    nxt = m.forward_cached(nxt, one, cache)[:, 0].argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                for _ in range(new):
                    nxt = m.forward_cached(nxt, one, cache)[:, 0].argmax(-1, keepdim=True)
                best = min(best, time.perf_counter() - t0)
        out[batch] = batch * new / best
    return out


def cpp_decode(path, layers, batches, new, threads, reps):
    out = subprocess.run([path, "--decode=" + ",".join(map(str, batches)), "--update=", f"--layers={layers}",
                          f"--new={new}", f"--threads={threads}", f"--reps={reps}", "--benchmark_format=json"],
                         check=True, capture_output=True, text=True).stdout
    return {int(b["name"].split("/")[1]): b["items_per_second"] for b in json.loads(out)["benchmarks"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpp", help="path of bench_hf, to run the unirl side too")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--new", type=int, default=32, help="timed greedy steps")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="timed decodes per side and round (the fastest counts)")
    ap.add_argument("--rounds", type=int, default=2, help="Python then unirl, this many times (the fastest counts)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.layers} layers at Qwen2.5-0.5B shapes, "
          f"prompt {PROMPT}, {a.new} timed greedy steps; load average {os.getloadavg()[0]:.2f}")
    d_full, d_cache = qwen2_py.check()
    print(f"python model vs hf_reference.py: max |logit diff| {d_full:.2g} (full), {d_cache:.2g} (KV cache)")
    mc, py, cpp = {}, {}, {}
    for r in range(a.rounds):  # alternating sides, so that both meet the same load; the best of each counts
        for k, v in machine().items():
            mc[k] = max(mc.get(k, 0.0), v)
        for b, v in python_decode(a.layers, batches, a.new, a.reps).items():
            py[b] = max(py.get(b, 0.0), v)
        line = f"round {r + 1}: python " + ", ".join(f"{v:.2f}" for v in py.values())
        if a.cpp:
            for b, v in cpp_decode(a.cpp, a.layers, batches, a.new, a.threads, a.reps).items():
                cpp[b] = max(cpp.get(b, 0.0), v)
            line += ", unirl " + ", ".join(f"{v:.2f}" for v in cpp.values())
        print(line + f" tokens/s (best so far, batches {a.batches}); sgemm {mc['sgemm_decode']:.1f} GFLOP/s, "
              f"read {mc['read_GBps']:.1f} GB/s (best so far); load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"machine (best of the rounds): sgemm {mc['sgemm_decode']:.1f} GFLOP/s at (64x896)@(896x4864), "
          f"{mc['sgemm_square']:.1f} GFLOP/s at 2048^3; read {mc['read_GBps']:.1f} GB/s (sum of 1 GiB), "
          f"copy {mc['copy_GBps']:.1f} GB/s (read + write)")
    print()
    print("| batch | Python tokens/s | unirl tokens/s | unirl / Python | unirl GFLOP/s | % of sgemm (decode shape / square) "
          "| weights + KV read per step | bandwidth bound tokens/s | unirl % of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        flops, step_bytes = model_figures(a.layers, b, a.new)
        bound = b * mc["read_GBps"] * 1e9 / step_bytes
        u = cpp.get(b)
        gf = (u if u else py[b]) * flops / 1e9
        fmt = lambda x: f"{x:,.2f}" if x < 10 else f"{x:,.1f}"  # noqa: E731
        cells = [str(b), fmt(py[b]), fmt(u) if u else "-", f"**{u / py[b]:.2f}x**" if u else "-",
                 f"{gf:.1f}", f"{100 * gf / mc['sgemm_decode']:.0f} % / {100 * gf / mc['sgemm_square']:.0f} %",
                 f"{step_bytes / 1e6:,.0f} MB", f"{bound:,.1f}", f"{100 * (u or py[b]) / bound:.0f} %"]
        print("| " + " | ".join(cells) + " |")
    print(f"\nload average after the run: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
