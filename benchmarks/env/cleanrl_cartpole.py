#!/usr/bin/env python3
"""CleanRL-equivalent PPO on CartPole-v1 in Python (PyTorch), for a side-by-side throughput
comparison with unirl's examples/10_cartpole_ppo.

The training loop follows CleanRL's ppo.py (4 envs x 128 steps, GAE 0.99/0.95, 4 epochs x 4
minibatches, clip 0.2, entropy 0.01, value 0.5 with clipping, max grad norm 0.5, Adam eps 1e-5,
lr 2.5e-4 annealed, orthogonal init). Gym is not needed: CartPole-v1 and a synchronous vector
env with auto-reset and episode statistics are written out below with Gym's dynamics.

    python3 cleanrl_cartpole.py --total-timesteps 500000 --seed 1 --out summary.json
"""
import argparse
import math

import numpy as np
import torch.nn as nn
from torch.distributions.categorical import Categorical

import cleanrl_ppo
from cleanrl_ppo import layer_init


class CartPole:
    """Gym's CartPole-v1 (euler), float64 state, 500-step time limit."""

    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = masscart + masspole
    polemass_length = masspole * length
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(self, max_steps=500):
        self.max_steps = max_steps
        self.rng = np.random.default_rng()

    def reset(self, seed=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.state = self.rng.uniform(-0.05, 0.05, size=4).tolist()
        self.steps = 0
        return np.array(self.state, dtype=np.float32)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta, sintheta = math.cos(theta), math.sin(theta)
        temp = (force + self.polemass_length * theta_dot ** 2 * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta ** 2 / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x += self.tau * x_dot
        x_dot += self.tau * xacc
        theta += self.tau * theta_dot
        theta_dot += self.tau * thetaacc
        self.state = [x, x_dot, theta, theta_dot]
        self.steps += 1
        terminated = x < -self.x_threshold or x > self.x_threshold or \
            theta < -self.theta_threshold or theta > self.theta_threshold
        truncated = (not terminated) and self.steps >= self.max_steps
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated


class SyncVectorEnv(cleanrl_ppo.SyncVectorEnv):
    """N copies of CartPole; auto-reset; episode statistics."""

    def __init__(self, n, seed):
        super().__init__([CartPole() for _ in range(n)], seed)
        self.obs = self.raw_obs

    def step(self, actions):
        obs, rewards, dones = self.step_raw([int(a) for a in actions])
        return obs, rewards.astype(np.float32), dones


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(4, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
                                    layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(4, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)), nn.Tanh(),
                                   layer_init(nn.Linear(64, 2), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--total-timesteps", type=int, default=500000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=str, default="")
    args = p.parse_args()
    num_envs, num_steps, lr, gamma, lam = 4, 128, 2.5e-4, 0.99, 0.95
    num_minibatches, update_epochs, clip_coef, ent_coef, vf_coef, max_grad_norm = 4, 4, 0.2, 0.01, 0.5, 0.5
    num_iterations = args.total_timesteps // (num_envs * num_steps)

    cleanrl_ppo.seed_everything(args.seed)

    envs = SyncVectorEnv(num_envs, args.seed)
    global_step, seconds = cleanrl_ppo.train(envs, Agent(), 4, (), num_envs, num_steps, num_iterations, lr, gamma, lam,
                                             num_minibatches, update_epochs, clip_coef, ent_coef, vf_coef,
                                             max_grad_norm, discrete=True)
    cleanrl_ppo.write_summary(envs, {"env": "CartPole-v1", "seed": args.seed}, global_step, seconds, args.out)

if __name__ == "__main__":
    main()
