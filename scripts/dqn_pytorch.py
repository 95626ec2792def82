#!/usr/bin/env python3
"""The DQN agent of `examples/dqn_minatar` in PyTorch, for the side-by-side comparison.

An optional tool, not part of CI: it needs `torch` and `minatar` (pinned: 1.0.15, the version
`tests/data/minatar` was recorded from). The same agent and settings as the Rust example
(MinAtar's published DQN, Young and Tian 2019), on the Python environment
`minatar.Environment('breakout')` (sticky actions 0.1, 6 actions):

- network: conv 16 3x3 stride 1 ReLU, dense 128 ReLU, one Q-value per action;
- replay buffer 100,000, batch 32, one update per frame from frame 5,000 on (random actions
  before), target network copied every 1,000 frames;
- epsilon linear from 1.0 to 0.1 over the 100,000 frames after learning starts; gamma 0.99;
- Huber loss (`smooth_l1_loss`, beta 1) on the taken action's Q-value;
- centered RMSprop: lr 0.00025, alpha 0.95, eps 0.01.

Acting is the network at batch 1 under `torch.inference_mode()`; learning is forward and
backward at batch 32. Prints a line every 100,000 frames and last

    DQN_RESULT {"backend":"pytorch","frames":...,"frames_per_second":...,"mean_return":...,
                "episodes":...,"seed":...,"threads":...,"flush_denormals":...}

with `mean_return` the mean return of the last 100 training episodes, as the Rust example's.

    python3 scripts/dqn_pytorch.py [--frames 300000] [--seed 1] [--threads 1] [--flush-denormals]
                                   [--returns FILE]
"""

import argparse
import json
import sys
import time

import numpy as np

REPLAY = 100_000
BATCH = 32
LEARN_FROM = 5_000
TARGET_EVERY = 1_000
EXPLORE_FRAMES = 100_000
GAMMA = 0.99


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=300_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--flush-denormals", action="store_true",
                        help="torch.set_flush_denormal(True), as the Rust example's flag")
    parser.add_argument("--returns", help="write (frame, return) per episode as CSV here")
    args = parser.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from minatar import Environment
    except ImportError as e:
        sys.exit(f"dqn_pytorch: needs torch and minatar==1.0.15 ({e})")

    torch.set_num_threads(args.threads)
    if args.flush_denormals and not torch.set_flush_denormal(True):
        sys.exit("dqn_pytorch: this CPU cannot flush denormals")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    env = Environment("breakout")
    env.seed(args.seed)
    actions_n = env.num_actions()
    h, w, c = env.state_shape()

    def make():
        return torch.nn.Sequential(
            torch.nn.Conv2d(c, 16, 3), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear((h - 2) * (w - 2) * 16, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, actions_n))

    net, target = make(), make()
    target.load_state_dict(net.state_dict())
    optimizer = torch.optim.RMSprop(net.parameters(), lr=0.00025, alpha=0.95, centered=True,
                                    eps=0.01)

    states = np.zeros((REPLAY, c, h, w), dtype=np.bool_)
    nexts = np.zeros((REPLAY, c, h, w), dtype=np.bool_)
    acts = np.zeros(REPLAY, dtype=np.int64)
    rewards = np.zeros(REPLAY, dtype=np.float32)
    terminal = np.zeros(REPLAY, dtype=np.bool_)
    size, head = 0, 0

    def observe():
        return np.transpose(env.state(), (2, 0, 1))

    episodes = []
    episode_return = 0.0
    env.reset()
    s = observe()
    start = time.perf_counter()
    for frame in range(1, args.frames + 1):
        if frame <= LEARN_FROM:
            epsilon = 1.0
        else:
            epsilon = 1.0 + (0.1 - 1.0) * min(1.0, (frame - LEARN_FROM) / EXPLORE_FRAMES)
        if rng.random() < epsilon:
            action = int(rng.integers(actions_n))
        else:
            with torch.inference_mode():
                q = net(torch.from_numpy(s).float().unsqueeze(0))
            action = int(q.argmax(dim=1).item())
        reward, done = env.act(action)
        s2 = observe()
        states[head], nexts[head], acts[head] = s, s2, action
        rewards[head], terminal[head] = reward, done
        head = (head + 1) % REPLAY
        size = min(size + 1, REPLAY)
        episode_return += reward
        if done:
            episodes.append((frame, episode_return))
            episode_return = 0.0
            env.reset()
            s = observe()
        else:
            s = s2

        if frame > LEARN_FROM:
            picks = rng.integers(size, size=BATCH)
            x = torch.from_numpy(states[picks]).float()
            x2 = torch.from_numpy(nexts[picks]).float()
            a = torch.from_numpy(acts[picks])
            with torch.no_grad():
                best = target(x2).max(dim=1).values
                done_mask = torch.from_numpy(terminal[picks]).float()
                y = torch.from_numpy(rewards[picks]) + GAMMA * (1.0 - done_mask) * best
            q_taken = net(x).gather(1, a.unsqueeze(1)).squeeze(1)
            loss = F.smooth_l1_loss(q_taken, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if frame % TARGET_EVERY == 0:
            target.load_state_dict(net.state_dict())
        if frame % 100_000 == 0:
            fps = frame / (time.perf_counter() - start)
            last = [r for _, r in episodes[-100:]]
            print(f"frame {frame}: {fps:.0f} frames/s, epsilon {epsilon:.3f}, episodes "
                  f"{len(episodes)}, mean return (last 100) {np.mean(last) if last else 0:.2f}",
                  flush=True)

    elapsed = time.perf_counter() - start
    last = [r for _, r in episodes[-100:]]
    if args.returns:
        with open(args.returns, "w") as f:
            f.write("frame,return\n")
            for frame, r in episodes:
                f.write(f"{frame},{r}\n")
    result = {
        "backend": "pytorch", "frames": args.frames,
        "frames_per_second": round(args.frames / elapsed, 1),
        "mean_return": round(float(np.mean(last)) if last else 0.0, 4),
        "episodes": len(episodes), "seed": args.seed, "threads": args.threads,
        "flush_denormals": args.flush_denormals,
    }
    print("DQN_RESULT " + json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
