#!/usr/bin/env python3
"""One GRPO update at Qwen2.5-0.5B's layer shapes: unirl (bench_hf) and Python PyTorch side by side,
with the LM head's log-probs chunked and materialised, each case in its own process (peak memory).

The update of S sequences x (64 prompt + 192 completion tokens), groups of 8, random tokens:
the training forward over prompt + completion, the log-probs (and entropies) of the completion
tokens, pi_old = the same forward detached (one update per step), the clipped loss (0.2)
aggregated seq-mean-token-mean, backward, gradient-norm clip 1, AdamW lr 1e-6 — forward +
backward + optimizer step, timed; tokens/s = S * 256 / seconds. Peak memory: ru_maxrss of the
process (model, optimizer state, activations; the Python figure includes the interpreter).

- unirl: bench_hf's BM_hf_grpo_update, the update of unirl::trainer::step with algo::grpo<>
  (layout padded). chunked: the hf model is a HiddenStateCausalLM, so the update runs the LM head
  and log-softmax in row chunks (ops::linear_logprob: the (N, V) logits are never held, the
  backward recomputes each chunk); materialised: the same network behind an adapter with
  logits() only (the whole (B, P+T-1, V) logits).
- Python: qwen2_py.Qwen2, hidden states of the completion positions then either the logits
  (B, T, V) and log_softmax (as TRL with logits_to_keep; entropy without gradient), or the same
  row-chunked op as unirl's, op for op, written as a torch.autograd.Function.

    python3 benchmarks/hf/grpo_update_compare.py --cpp build/benchmarks/hf/bench_hf --layers 2
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import qwen2_py

PROMPT, COMPLETION, GROUP = 64, 192, 8
V = qwen2_py.QWEN25_05B["vocab"]
CHUNK = max(1, (1 << 25) // V)  # rows per chunk: unirl's rollout::lm_head_chunk_rows(V)


class ChunkedLinearLogprob(torch.autograd.Function):
    """log_softmax(h @ w^T) at the targets and the entropies, `chunk` rows at a time, the backward
    recomputing each chunk's logits: unirl's ops::linear_logprob op for op (two reused (chunk, V)
    buffers, the head's gradient accumulated in place), in Python."""

    @staticmethod
    def forward(ctx, h, w, t, chunk):
        n, v = h.shape[0], w.shape[0]
        logp, ent, lse = h.new_empty(n), h.new_empty(n), h.new_empty(n)
        rows = max(1, min(chunk, n))
        x_buf, l_buf = h.new_empty(rows, v), h.new_empty(rows, v)
        with torch.no_grad():
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                x, l, tc = x_buf[:hi - lo], l_buf[:hi - lo], t[lo:hi, None]
                torch.mm(h[lo:hi], w.t(), out=x)
                torch._log_softmax(x, 1, False, out=l)
                lp = l.gather(1, tc).squeeze(1)
                logp[lo:hi] = lp
                lse[lo:hi] = x.gather(1, tc).squeeze(1) - lp
                torch.exp(l, out=x).mul_(l)
                torch.sum(x, 1, out=ent[lo:hi]).neg_()
        ctx.save_for_backward(h, w, t, lse, ent)
        ctx.chunk = chunk
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, t, lse, ent = ctx.saved_tensors
        chunk, n, v = ctx.chunk, h.shape[0], w.shape[0]
        g_logp = torch.zeros(n) if g_logp is None else g_logp
        g_ent = torch.zeros(n) if g_ent is None else g_ent
        a, b = g_ent[:, None], (g_logp + g_ent * ent)[:, None]
        g_h, g_w = torch.empty_like(h), torch.zeros_like(w)
        rows = max(1, min(chunk, n))
        x_buf, p_buf = h.new_empty(rows, v), h.new_empty(rows, v)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            x, p, hc = x_buf[:hi - lo], p_buf[:hi - lo], h[lo:hi]
            torch.mm(hc, w.t(), out=x).sub_(lse[lo:hi, None])  # log p
            torch.exp(x, out=p)
            x.mul_(a[lo:hi]).add_(b[lo:hi]).mul_(p).neg_()
            x.scatter_add_(1, t[lo:hi, None], g_logp[lo:hi, None])
            torch.mm(x, w, out=g_h[lo:hi])
            g_w.addmm_(x.t(), hc)
        return g_h, g_w, None, None


def python_update(layers, sequences, chunked):
    torch.manual_seed(0)
    model = qwen2_py.Qwen2(dict(qwen2_py.QWEN25_05B, layers=layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    torch.manual_seed(1)
    prompts = torch.randint(0, V, (sequences // GROUP, PROMPT)).repeat_interleave(GROUP, 0)
    comp = torch.randint(0, V, (sequences, COMPLETION))
    cmask = torch.ones(sequences, COMPLETION)
    reward = ((comp < V // 2).float() * cmask).sum(1) / cmask.sum(1)
    g = reward.view(-1, GROUP)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    full = torch.cat([prompts, comp], 1)
    mask = torch.ones(full.shape)

    t0 = time.perf_counter()
    h = model.hidden_states(full[:, :-1], mask[:, :-1])[:, PROMPT - 1:]
    w = model.head_weight()
    if chunked:
        logp, ent = ChunkedLinearLogprob.apply(h.reshape(-1, h.shape[-1]), w, comp.reshape(-1), CHUNK)
        logp, ent = logp.view(comp.shape), ent.view(comp.shape)
    else:
        lsm = torch.log_softmax(F.linear(h, w).float(), -1)
        logp = lsm.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            ent = -(lsm.exp() * lsm).sum(-1)
    old = logp.detach()
    ratio = torch.exp(logp - old)
    pl = torch.max(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.2))
    loss = ((pl * cmask).sum(1) / cmask.sum(1)).mean()
    entropy = ((ent.detach() * cmask).sum(1) / cmask.sum(1)).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    loss, entropy = loss.item(), entropy.item()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "tokens_per_s": sequences * (PROMPT + COMPLETION) / dt, "loss": loss}


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_case(args, side, sequences, chunked):
    """One case in a fresh process: {'tokens_per_s', 'seconds', 'peak_rss_MiB'}."""
    if side == "python":
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{sequences}:{int(chunked)}",
               "--layers", str(args.layers), "--threads", str(args.threads)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    cmd = [args.cpp, "--decode=", f"--update={sequences}:{int(chunked)}", f"--layers={args.layers}",
           f"--threads={args.threads}", "--benchmark_format=json"]
    b = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)["benchmarks"][0]
    return {"tokens_per_s": b["items_per_second"], "seconds": b["real_time"] / 1e3, "peak_rss_MiB": b["peak_rss_MiB"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpp", help="path of bench_hf, to run the unirl side too")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=64, help="the chunked cases")
    ap.add_argument("--materialised-sequences", type=int, default=16,
                    help="the materialised cases (and the chunked ones again at this size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate the two sides this many times per case; the fastest of each counts")
    ap.add_argument("--cases", default="chunked,materialised,chunked-small",
                    help="which of: chunked (--sequences), materialised and chunked-small (--materialised-sequences)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.child:
        s, c = (int(x) for x in a.child.split(":"))
        r = python_update(a.layers, s, bool(c))
        r["peak_rss_MiB"] = peak_rss_mib()
        print(json.dumps(r))
        return
    print(f"torch {torch.__version__}, {a.threads} threads, {a.layers} layers at Qwen2.5-0.5B shapes, sequences of "
          f"{PROMPT} + {COMPLETION} tokens, LM-head chunk {CHUNK} rows; load average {os.getloadavg()[0]:.2f}")
    for s in (a.sequences, a.materialised_sequences):
        print(f"  {s} sequences: the completion logits alone are {s * COMPLETION * V * 4 / 2**30:.1f} GiB "
              f"(prompt + completion: {s * (PROMPT + COMPLETION - 1) * V * 4 / 2**30:.1f} GiB)")
    known = {"chunked": (a.sequences, True), "materialised": (a.materialised_sequences, False),
             "chunked-small": (a.materialised_sequences, True)}
    cases = [known[c] for c in a.cases.split(",") if c]
    sides = ["python"] + (["unirl"] if a.cpp else [])
    rows = []
    for s, chunked in cases:
        r = {}
        for rnd in range(a.rounds):  # alternating sides, so both meet the same load; the fastest counts
            for side in sides:
                x = run_case(a, side, s, chunked)
                if side not in r or x["tokens_per_s"] > r[side]["tokens_per_s"]:
                    r[side] = dict(x, peak_rss_MiB=max(x["peak_rss_MiB"], r.get(side, x)["peak_rss_MiB"]))
            print(f"  round {rnd + 1}: {s} sequences, {'chunked' if chunked else 'materialised'}: "
                  + ", ".join(f"{k} {v['tokens_per_s']:.0f} tokens/s, {v['peak_rss_MiB']:.0f} MiB" for k, v in r.items())
                  + f" (best so far); load average {os.getloadavg()[0]:.2f}", flush=True)
        rows.append((s, chunked, r))
    print()
    print("| sequences x 256 tokens | LM-head log-probs | Python tokens/s | unirl tokens/s | unirl / Python "
          "| Python peak RSS | unirl peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for s, chunked, r in rows:
        p, u = r["python"], r.get("unirl")
        print(f"| {s} | {'chunked' if chunked else 'materialised'} | {p['tokens_per_s']:,.0f} | "
              + (f"{u['tokens_per_s']:,.0f} | **{u['tokens_per_s'] / p['tokens_per_s']:.2f}x** | " if u else "- | - | ")
              + f"{p['peak_rss_MiB'] / 1024:.1f} GiB | " + (f"{u['peak_rss_MiB'] / 1024:.1f} GiB |" if u else "- |"))
    print(f"\nload average after the run: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
