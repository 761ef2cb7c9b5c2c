#!/usr/bin/env python3
"""One-row linear layers at Qwen2.5-0.5B shapes: torch.mv (unirl's `dense` for a batch-1 decoding
step) against the one-row torch.mm and F.linear a Python decoding loop runs. Two threads, the
three alternating, best of 15 (run it with the torch that LibTorch links, as decode_compare.py).

    python3 benchmarks/hf/gemv_vs_gemm.py
"""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
for out_f, in_f in ((151936, 896), (4864, 896), (896, 4864), (1152, 896)):  # LM head, gate/up, down, fused q/k/v
    w, x = torch.randn(out_f, in_f), torch.randn(in_f)
    ops = {"mv": lambda: torch.mv(w, x), "mm": lambda: torch.mm(x.view(1, -1), w.t()),
           "linear": lambda: F.linear(x.view(1, 1, -1), w)}
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(15):
        for k, f in ops.items():
            t0 = time.perf_counter()
            f()
            f()
            best[k] = min(best[k], (time.perf_counter() - t0) / 2)
    print(f"({out_f} x {in_f}): " + ", ".join(f"{k} {v * 1e3:.2f} ms ({out_f * in_f * 4 / v / 1e9:.1f} GB/s)"
                                              for k, v in best.items()), flush=True)
