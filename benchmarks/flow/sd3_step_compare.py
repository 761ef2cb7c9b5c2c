"""One Flow-GRPO step (LoRA) of the small SD3 that bench_sd3_step writes, in plain eager PyTorch,
per stage: text encoding, sampling, VAE decode, reward, update — time and the peak resident set
of each (VmHWM, reset through /proc/self/clear_refs before each stage, as unirl's memory tracker).

    python3 benchmarks/flow/sd3_step_compare.py --model DIR [--checkpointing 0] [--steps 3]

The modules are tests/fixtures/diffusers/sd3_reference.py (written from diffusers' and
transformers' modelling code; unirl's components equal them to 1e-5); the step is written as
Flow-GRPO's reference code does it: prompts encoded once per step (as a diffusers pipeline call
does), the SDE rollout with its log-probs under no_grad, the VAE decode, the reward, group
advantages, then every SDE step replayed with gradients on the LoRA weights, the reference (LoRA
off) replayed without, the clipped surrogate + beta KL summed over the steps, one backward,
gradient clipping and AdamW. Same configuration as bench_sd3_step: 2 prompts x 4 samples, 6 SDE
steps, guidance 4.5, LoRA rank 8 / alpha 16 on the attention and MLP linears, beta 0.04.
Prints one JSON object per measured step (after a warm-up step), then the medians.
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures", "diffusers"))
sys.dont_write_bytecode = True
import sd3_reference as ref  # noqa: E402

if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0: the composite it stands for
    def _sdpa(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    F.scaled_dot_product_attention = _sdpa

PROMPTS = ["a photo of a cat", "a red cube on a blue table"]
TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
           "ff_context.net.2")
DTYPES = {"F32": np.float32, "F64": np.float64, "I64": np.int64}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def load(module, folder, stem):
    """The weights of a component folder: <stem>.safetensors, or its shards through the index."""
    single = os.path.join(folder, stem + ".safetensors")
    if os.path.exists(single):
        sd = read_safetensors(single)
    else:
        index = json.load(open(os.path.join(folder, stem + ".safetensors.index.json")))
        sd = {}
        for shard in sorted(set(index["weight_map"].values())):
            sd.update(read_safetensors(os.path.join(folder, shard)))
    sd.pop("text_model.embeddings.position_ids", None)
    module.load_state_dict(sd, strict=True)
    return module


class LoRA(nn.Module):
    on = True  # off: the reference (the base weights)

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base, self.scaling = base, alpha / r
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = self.base(x)
        return y + self.scaling * self.lora_B(self.lora_A(x)) if LoRA.on else y


def apply_lora(model, r, alpha):
    for name, mod in list(model.named_modules()):
        for child, sub in list(mod.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(sub, nn.Linear) and full.startswith("transformer_blocks.") and full.endswith(TARGETS):
                setattr(mod, child, LoRA(sub, r, alpha))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return [p for p in model.parameters() if p.requires_grad]


def transformer_forward(tr, x, t, ctx, pooled, checkpointing):
    """SD3Transformer.forward with each block optionally recomputed in the backward."""
    h, w = x.shape[-2:]
    hs = tr.pos_embed(x)
    temb = tr.time_text_embed(t, pooled)
    cs = tr.context_embedder(ctx)
    for blk in tr.transformer_blocks:
        if checkpointing and torch.is_grad_enabled():
            cs, hs = torch.utils.checkpoint.checkpoint(blk, hs, cs, temb, use_reentrant=False)
        else:
            cs, hs = blk(hs, cs, temb)
    hs = tr.proj_out(tr.norm_out(hs, temb))
    p, c = tr.cfg["patch_size"], tr.out_channels
    hs = hs.reshape(hs.shape[0], h // p, w // p, p, p, c)
    return torch.einsum("nhwpqc->nchpwq", hs).reshape(hs.shape[0], c, h, w)


def flow_grid(steps, shift):
    ts = [shift * (1 - k / steps) / (1 + (shift - 1) * (1 - k / steps)) for k in range(steps + 1)]
    ts[-1] = 0.0
    return ts


def sde_coefficients(t, tn, a):  # Flow-GRPO's SDE: mean = c0 x + c1 v, std
    dt = tn - t
    sigma = a * math.sqrt(t / ((1 - tn) if t >= 1 else (1 - t)))
    k = sigma * sigma / (2 * t)
    return 1 + k * dt, dt * (1 + k * (1 - t)), sigma * math.sqrt(-dt)


def log_prob(x, mean, std):
    return (-(x - mean) ** 2 / (2 * std * std) - math.log(std) - 0.5 * math.log(2 * math.pi)).flatten(1).mean(1)


class Mem:
    """Peak resident set of a stage (VmHWM after resetting it), in MiB."""

    @staticmethod
    def start():
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    @staticmethod
    def current():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        return 0.0

    @staticmethod
    def peak():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--checkpointing", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = lambda c: json.load(open(os.path.join(a.model, c, "config.json")))
    part = lambda c: os.path.join(a.model, c)
    tr = load(ref.SD3Transformer(cfg("transformer")), part("transformer"), "diffusion_pytorch_model")
    vae = load(ref.AutoencoderKL(cfg("vae")), part("vae"), "diffusion_pytorch_model")
    te1 = load(ref.CLIPTextModelWithProjection(cfg("text_encoder")), part("text_encoder"), "model")
    te2 = load(ref.CLIPTextModelWithProjection(cfg("text_encoder_2")), part("text_encoder_2"), "model")
    for m in (vae, te1, te2):
        m.requires_grad_(False)
    tok1, tok2 = ref.CLIPTokenizer(os.path.join(a.model, "tokenizer")), ref.CLIPTokenizer(os.path.join(a.model, "tokenizer_2"))
    sched = json.load(open(os.path.join(a.model, "scheduler", "scheduler_config.json")))
    pipe = ref.SD3Pipeline(tr, vae, te1, te2, tok1, tok2, sched, t5_tokens=77)
    params = apply_lora(tr, 8, 16.0)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    G, K, w, beta, noise, clip = 4, 6, 4.5, 0.04, 0.7, 1e-4
    grid = flow_grid(K, 3.0)
    vc = vae.cfg
    figures = {}
    baseline = Mem.current()  # the loaded pipeline and optimizer, before any step
    for step in range(a.steps + 1):
        row = {"step": step, "checkpointing": bool(a.checkpointing), "baseline_mb": baseline}
        t0, c0 = time.perf_counter(), time.process_time()  # wall, and the process's CPU time
        # Text encoding: the step's prompts and the empty one, once (a pipeline call's encode_prompt).
        Mem.start()
        t = time.perf_counter()
        with torch.no_grad():
            ctx, pooled = pipe.encode_prompt(PROMPTS + [""])
        ctx_c, pooled_c = ctx[:2].repeat_interleave(G, 0), pooled[:2].repeat_interleave(G, 0)
        ctx_u, pooled_u = ctx[2:].expand(2 * G, -1, -1), pooled[2:].expand(2 * G, -1)
        cat_ctx, cat_pooled = torch.cat([ctx_u, ctx_c]), torch.cat([pooled_u, pooled_c])
        row["text_encoding_s"], row["text_encoding_peak_mb"] = time.perf_counter() - t, Mem.peak()

        def velocity(x, tt):
            v = transformer_forward(tr, torch.cat([x, x]), torch.full((2 * x.shape[0],), tt * 1000.0), cat_ctx, cat_pooled,
                                    a.checkpointing)
            u, c = v.chunk(2)
            return u + w * (c - u)

        # Sampling: the SDE rollout with its log-probs.
        Mem.start()
        t = time.perf_counter()
        with torch.no_grad():
            tc = tr.cfg
            x = torch.randn(2 * G, tc["in_channels"], tc["sample_size"], tc["sample_size"])
            xs, logps = [x], []
            for k in range(K):
                c0, c1, sd = sde_coefficients(grid[k], grid[k + 1], noise)
                mean = c0 * x + c1 * velocity(x, grid[k])
                x = mean + sd * torch.randn_like(x)
                xs.append(x)
                logps.append(log_prob(x, mean, sd))
        row["sampling_s"], row["sampling_peak_mb"] = time.perf_counter() - t, Mem.peak()
        # VAE decode, then the reward (mean pixel in [0, 1]).
        Mem.start()
        t = time.perf_counter()
        with torch.no_grad():
            img = vae.decode(x / vc["scaling_factor"] + vc["shift_factor"])
        row["vae_decode_s"] = time.perf_counter() - t
        t = time.perf_counter()
        r = ((img.clamp(-1, 1) + 1) / 2).flatten(1).mean(1)
        row["reward_s"], row["reward_peak_mb"] = time.perf_counter() - t, Mem.peak()
        # Update: group advantages, every step replayed on the policy (grad) and the reference.
        Mem.start()
        t = time.perf_counter()
        g = r.view(2, G)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).reshape(-1).clamp(-5, 5)
        total = 0.0
        for k in range(K):
            c0, c1, sd = sde_coefficients(grid[k], grid[k + 1], noise)
            mean = c0 * xs[k] + c1 * velocity(xs[k], grid[k])
            ratio = torch.exp(log_prob(xs[k + 1], mean, sd) - logps[k])
            pl = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean()
            with torch.no_grad():
                LoRA.on = False
                ref_mean = c0 * xs[k] + c1 * velocity(xs[k], grid[k])
                LoRA.on = True
            kl = ((mean - ref_mean) ** 2 / (2 * sd * sd)).flatten(1).mean(1).mean()
            total = total + pl + beta * kl
        loss = total / K
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        row["update_s"], row["update_peak_mb"] = time.perf_counter() - t, Mem.peak()
        row["step_s"], row["step_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
        row["reward_mean"], row["loss"] = r.mean().item(), loss.item()
        print(json.dumps(row), flush=True)
        if step > 0:
            for key, v in row.items():
                if isinstance(v, float):
                    figures.setdefault(key, []).append(v)
    med = {k: sorted(v)[len(v) // 2] for k, v in figures.items()}
    med.update({"median_of": a.steps, "checkpointing": bool(a.checkpointing), "torch": torch.__version__,
                "torch_threads": torch.get_num_threads()})
    print("median " + json.dumps(med, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
