#!/usr/bin/env python3
"""CleanRL-equivalent PPO on Pendulum-v1 in Python (PyTorch), for a side-by-side throughput
comparison with unirl's examples/11_pendulum_ppo (--preset cleanrl by default here).

The training loop follows CleanRL's ppo_continuous_action.py (1 env x 2048 steps, GAE 0.99/0.95,
10 epochs x 32 minibatches, clip 0.2 with the value clipped too, no entropy bonus, value 0.5,
max grad norm 0.5, Adam eps 1e-5, lr 3e-4 annealed, orthogonal init, state-independent log-std)
with Gym's wrappers as CleanRL stacks them: ClipAction, NormalizeObservation (clipped to +-10),
NormalizeReward (gamma, clipped to +-10). Gym is not needed: Pendulum-v1, the wrappers and a
synchronous vector env with auto-reset and episode statistics are written out below.
`--preset tuned` uses the C++ example's default preset instead (4 envs x 512 steps, gamma 0.9,
lr 1e-3).

    python3 cleanrl_pendulum.py --total-timesteps 1000000 --seed 1 --out summary.json
"""
import argparse
import math

import numpy as np
import torch
import torch.nn as nn
from torch.distributions.normal import Normal

import cleanrl_ppo
from cleanrl_ppo import layer_init


class Pendulum:
    """Gym's Pendulum-v1, 200-step time limit."""

    max_speed, max_torque, dt, g, m, l = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0

    def __init__(self, max_steps=200):
        self.max_steps = max_steps
        self.rng = np.random.default_rng()

    def reset(self, seed=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.th = self.rng.uniform(-math.pi, math.pi)
        self.thdot = self.rng.uniform(-1.0, 1.0)
        self.steps = 0
        return self._obs()

    def _obs(self):
        return np.array([math.cos(self.th), math.sin(self.th), self.thdot], dtype=np.float32)

    def step(self, u):
        u = float(np.clip(u, -self.max_torque, self.max_torque))  # ClipAction
        th, thdot = self.th, self.thdot
        an = ((th + math.pi) % (2 * math.pi)) - math.pi
        cost = an ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2
        newthdot = thdot + (3 * self.g / (2 * self.l) * math.sin(th) + 3.0 / (self.m * self.l ** 2) * u) * self.dt
        newthdot = min(max(newthdot, -self.max_speed), self.max_speed)
        self.th = th + newthdot * self.dt
        self.thdot = newthdot
        self.steps += 1
        return self._obs(), -cost, False, self.steps >= self.max_steps


class RunningMeanStd:
    def __init__(self, shape=()):
        self.mean = np.zeros(shape, "float64")
        self.var = np.ones(shape, "float64")
        self.count = 1e-4

    def update(self, x):
        batch_mean, batch_var, n = np.mean(x, axis=0), np.var(x, axis=0), x.shape[0]
        delta = batch_mean - self.mean
        tot = self.count + n
        self.mean = self.mean + delta * n / tot
        self.var = (self.var * self.count + batch_var * n + delta ** 2 * self.count * n / tot) / tot
        self.count = tot


class SyncVectorEnv(cleanrl_ppo.SyncVectorEnv):
    """N copies of Pendulum stepped in turn; auto-reset; episode statistics on the raw rewards;
    then NormalizeObservation and NormalizeReward over the vector (as Gym's wrappers on a vector env)."""

    def __init__(self, n, seed, gamma):
        super().__init__([Pendulum() for _ in range(n)], seed)
        self.obs_rms, self.ret_rms = RunningMeanStd((3,)), RunningMeanStd(())
        self.discounted = np.zeros(n)
        self.gamma = gamma
        self.obs_rms.update(self.raw_obs)
        self.obs = self._norm_obs(self.raw_obs)

    def _norm_obs(self, raw):
        z = (raw - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + 1e-8)
        return np.clip(z, -10, 10).astype(np.float32)

    def step(self, actions):
        raw, rewards, dones = self.step_raw([a[0] for a in actions])
        self.obs_rms.update(raw)
        self.obs = self._norm_obs(raw)
        self.discounted = self.discounted * self.gamma + rewards
        self.ret_rms.update(self.discounted)
        out = np.clip(rewards / np.sqrt(self.ret_rms.var + 1e-8), -10, 10).astype(np.float32)
        self.discounted[dones == 1.0] = 0.0
        return self.obs.copy(), out, dones


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(3, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
                                    layer_init(nn.Linear(64, 1), std=1.0))
        self.actor_mean = nn.Sequential(layer_init(nn.Linear(3, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                        nn.Tanh(), layer_init(nn.Linear(64, 1), std=0.01))
        self.actor_logstd = nn.Parameter(torch.zeros(1, 1))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        action_mean = self.actor_mean(x)
        action_std = torch.exp(self.actor_logstd.expand_as(action_mean))
        probs = Normal(action_mean, action_std)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--total-timesteps", type=int, default=1000000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--preset", choices=["cleanrl", "tuned"], default="cleanrl")
    p.add_argument("--out", type=str, default="")
    args = p.parse_args()
    if args.preset == "cleanrl":
        num_envs, num_steps, lr, gamma = 1, 2048, 3e-4, 0.99
    else:
        num_envs, num_steps, lr, gamma = 4, 512, 1e-3, 0.9
    lam, num_minibatches, update_epochs, clip_coef, ent_coef, vf_coef, max_grad_norm = 0.95, 32, 10, 0.2, 0.0, 0.5, 0.5
    num_iterations = args.total_timesteps // (num_envs * num_steps)

    cleanrl_ppo.seed_everything(args.seed)

    envs = SyncVectorEnv(num_envs, args.seed, gamma)
    global_step, seconds = cleanrl_ppo.train(envs, Agent(), 3, (1,), num_envs, num_steps, num_iterations, lr, gamma,
                                             lam, num_minibatches, update_epochs, clip_coef, ent_coef, vf_coef,
                                             max_grad_norm, discrete=False)
    cleanrl_ppo.write_summary(envs, {"env": "Pendulum-v1", "preset": args.preset, "seed": args.seed}, global_step, seconds, args.out)

if __name__ == "__main__":
    main()
