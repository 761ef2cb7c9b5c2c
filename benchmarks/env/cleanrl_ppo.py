#!/usr/bin/env python3
"""CleanRL's PPO loop (ppo.py / ppo_continuous_action.py), shared by cleanrl_cartpole.py and
cleanrl_pendulum.py: rollout with the agent, GAE, epochs x minibatches of the clipped surrogate,
clipped value loss and entropy bonus, gradient clipping and Adam with the learning rate annealed
linearly, exactly as CleanRL writes it."""
import json
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim


class SyncVectorEnv:
    """N copies stepped in turn with auto-reset, recording each finished episode's raw return and
    length (Gym's SyncVectorEnv with RecordEpisodeStatistics). `step_raw` returns the raw next
    observations (float32), rewards (float64) and done flags (float32)."""

    def __init__(self, envs, seed):
        self.envs = envs
        self.returns = np.zeros(len(envs))
        self.lengths = np.zeros(len(envs), dtype=np.int64)
        self.episodes = []
        self.raw_obs = np.stack([e.reset(seed + i) for i, e in enumerate(envs)])

    def step_raw(self, actions):
        rewards = np.zeros(len(self.envs))
        dones = np.zeros(len(self.envs), dtype=np.float32)
        for i, (env, a) in enumerate(zip(self.envs, actions)):
            obs, r, term, trunc = env.step(a)
            rewards[i] = r
            self.returns[i] += r
            self.lengths[i] += 1
            if term or trunc:
                dones[i] = 1.0
                self.episodes.append((self.returns[i], int(self.lengths[i])))
                self.returns[i] = 0.0
                self.lengths[i] = 0
                obs = env.reset()
            self.raw_obs[i] = obs
        return self.raw_obs.copy(), rewards, dones


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def train(envs, agent, obs_dim, action_shape, num_envs, num_steps, num_iterations, lr, gamma, lam, num_minibatches,
          update_epochs, clip_coef, ent_coef, vf_coef, max_grad_norm, discrete):
    """Runs `num_iterations` PPO iterations; returns (environment steps, seconds)."""
    batch_size = num_envs * num_steps
    minibatch_size = batch_size // num_minibatches
    optimizer = optim.Adam(agent.parameters(), lr=lr, eps=1e-5)
    obs = torch.zeros((num_steps, num_envs, obs_dim))
    actions = torch.zeros((num_steps, num_envs) + action_shape)
    logprobs = torch.zeros((num_steps, num_envs))
    rewards = torch.zeros((num_steps, num_envs))
    dones = torch.zeros((num_steps, num_envs))
    values = torch.zeros((num_steps, num_envs))

    start = time.time()
    global_step = 0
    next_obs = torch.tensor(envs.obs)
    next_done = torch.zeros(num_envs)
    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * lr
        for step in range(num_steps):
            global_step += num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            o, r, d = envs.step(action.numpy())
            rewards[step] = torch.tensor(r)
            next_obs, next_done = torch.tensor(o), torch.tensor(d)
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(num_steps)):
                if t == num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
            returns = advantages + values
        b_obs = obs.reshape((-1, obs_dim))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape((-1,) + action_shape)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)
        b_inds = np.arange(batch_size)
        for epoch in range(update_epochs):
            np.random.shuffle(b_inds)
            for s in range(0, batch_size, minibatch_size):
                mb = b_inds[s:s + minibatch_size]
                mb_actions = b_actions.long()[mb] if discrete else b_actions[mb]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], mb_actions)
                logratio = newlogprob - b_logprobs[mb]
                ratio = logratio.exp()
                mb_adv = b_advantages[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
                newvalue = newvalue.view(-1)
                v_unclipped = (newvalue - b_returns[mb]) ** 2
                v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -clip_coef, clip_coef)
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
                loss = pg_loss - ent_coef * entropy.mean() + v_loss * vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
                optimizer.step()
    return global_step, time.time() - start


def seed_everything(seed):
    """CleanRL's seeding, and one LibTorch thread (as the C++ side runs)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(1)


def write_summary(envs, fields, global_step, seconds, out):
    """Prints (and writes to `out` when given) the run's summary: `fields`, the mean return of
    the last 20 episodes, the episode and step counts, the seconds and steps per second."""
    last = envs.episodes[-20:]
    summary = dict(fields, implementation="python-cleanrl",
                   final_mean_return=float(np.mean([e[0] for e in last])) if last else float("nan"),
                   episodes=len(envs.episodes), env_steps=global_step, seconds=seconds,
                   steps_per_second=global_step / seconds, torch=torch.__version__)
    print(json.dumps(summary, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)
