#!/usr/bin/env python3
"""Records MinAtar Breakout trajectories for tests/minatar_replay.rs into tests/data/minatar/.

The reference is the `minatar` package from PyPI, version 1.0.15 (MinAtar, Young and Tian,
2019), pinned: the script refuses to run against another version unless `--any-version` is
given (a new version must be reviewed for rule changes before its recordings replace these).

What is recorded, per trajectory: `Environment('breakout', sticky_action_prob=p)` with the
package's defaults otherwise (difficulty_ramping=True, which Breakout ignores), seeded with
`env.seed(seed)`, then a sequence of events:

- `reset`: `env.reset()`; the state after it;
- `act`: `env.act(a)` with an action `a` in 0..6 chosen by a policy with its own numpy
  RandomState (uniform over the 6 actions, uniform over `minimal_action_set()`, or a tracker
  that follows the ball, so that long episodes clear every brick and the rows come back);
  the action taken (`env.last_action`: `a`, or the previous action when the sticky-action draw
  repeated it), the reward, the terminal flag and the state after it.

Episodes end at `terminal`; sometimes a few more `act` calls follow a terminal one before the
reset (the package then returns (0, True), still draws the sticky-action number and still
remembers the action), and sometimes an episode is cut short by a reset, as a time limit would.

Every random draw the environment makes is recorded with the event that made it, in order: the
environment's numpy RandomState (shared by `Environment` and the game after `seed`) is replaced
by a wrapper that forwards `rand()` and `randint(n)` to it and logs the results, and refuses any
other use, so that no draw can go unrecorded. `act` draws one `rand()` (sticky action:
`rand() < p` repeats the previous action); `reset` draws one `randint(2)` (the ball starts at
the left or right wall). A draw is `["rand", k]` with `rand() == k / 2**53` exactly (numpy's
doubles have 53 random bits, so `k` is an integer and JSON carries it without rounding), or
`["randint", n, v]` for `randint(n) == v`.

A state (`env.state()`, bool, shape (10, 10, 4), channels paddle, ball, trail, brick) is
stored as `np.packbits(state.reshape(-1)).tobytes().hex()`: the 400 values in (row, column,
channel) order, 8 to a byte, the first value in the most significant bit: 100 hex digits.

The file also holds the return of a uniformly random policy (its own RandomState) over 20000
episodes, over the 6 actions and over the minimal action set, as this package computes it: the
Rust test repeats it with the same seeds and numpy's generator, which it reimplements.

Output: tests/data/minatar/breakout.json.gz (deterministic: fixed seeds, gzip mtime 0).

Regenerate:

    python3 -m venv /tmp/minatar-venv
    /tmp/minatar-venv/bin/pip install minatar==1.0.15
    /tmp/minatar-venv/bin/python scripts/record_minatar.py
"""

import argparse
import copy
import gzip
import importlib.metadata
import json
import os
import sys

import numpy as np
from minatar import Environment

MINATAR_VERSION = "1.0.15"
OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "minatar", "breakout.json.gz"
)

# (environment seed, policy, policy seed, number of act calls, sticky_action_prob,
#  probability per non-terminal step of cutting the episode short with a reset)
TRAJECTORIES = [
    (0, "uniform", 100, 400, 0.1, 0.01),
    (1, "uniform", 101, 400, 0.1, 0.01),
    (2, "minimal", 102, 400, 0.1, 0.01),
    (123456789, "tracker", 103, 900, 0.1, 0.0),
    (4294967295, "tracker_noisy", 104, 500, 0.1, 0.002),
    (7, "uniform", 105, 300, 0.25, 0.01),
]
# After a terminal step: probability of 1 to 3 further act calls before the reset.
P_ACT_AFTER_TERMINAL = 0.25
# The random-policy reference: episodes per action set.
REFERENCE_EPISODES = 20000


class RecordingRandom:
    """Forwards rand() and randint(n) to a numpy RandomState and logs each result."""

    def __init__(self, inner):
        self._inner = inner
        self.log = []

    def rand(self, *args):
        if args:
            raise RuntimeError("rand() with arguments is not recorded")
        v = self._inner.rand()
        k = int(v * 2.0**53)
        assert k / 2.0**53 == v and 0 <= k < 2**53
        self.log.append(["rand", k])
        return v

    def randint(self, n, *args, **kwargs):
        if args or kwargs:
            raise RuntimeError("randint() with more than one argument is not recorded")
        v = int(self._inner.randint(n))
        self.log.append(["randint", int(n), v])
        return v

    def __getattr__(self, name):
        raise RuntimeError(f"the environment used RandomState.{name}, which is not recorded")

    def take(self):
        log, self.log = self.log, []
        return log


def pack_state(state):
    assert state.shape == (10, 10, 4) and state.dtype == bool
    return np.packbits(state.reshape(-1)).tobytes().hex()


def tracker_action(game):
    """Moves the paddle to where the ball will be on row 8 heading down (simulated on a copy)."""
    sim = copy.copy(game)
    sim.brick_map = game.brick_map.copy()
    sim.random = None
    target = game.ball_x
    for _ in range(60):
        if sim.ball_y == 8 and sim.ball_dir in (2, 3):
            target = sim.ball_x
            break
        sim.pos = -5  # no paddle: the simulated ball passes row 9 and the loop ends
        sim.act(0)
        if sim.terminal:
            break
    if target < game.pos:
        return 1
    if target > game.pos:
        return 3
    return 0


def choose(policy, rng, env):
    if policy == "uniform":
        return int(rng.randint(6))
    if policy == "minimal":
        acts = env.minimal_action_set()
        return int(acts[rng.randint(len(acts))])
    eps = {"tracker": 0.02, "tracker_noisy": 0.15}[policy]
    if rng.rand() < eps:
        return int(rng.randint(6))
    return tracker_action(env.env)


def record(seed, policy, policy_seed, n_acts, sticky, p_truncate):
    env = Environment("breakout", sticky_action_prob=sticky)
    env.seed(seed)
    rec = RecordingRandom(env.random)
    env.random = rec
    env.env.random = rec
    rng = np.random.RandomState(policy_seed)

    events = []
    stats = {"episodes": 0, "terminals": 0, "acts_after_terminal": 0, "truncations": 0,
             "rewards": 0, "brick_refills": 0, "sticky_repeats": 0, "ball_on_brick": 0,
             "max_return": 0}

    def reset():
        env.reset()
        events.append({"op": "reset", "draws": rec.take(), "state": pack_state(env.state())})
        stats["episodes"] += 1

    reset()
    ret = 0
    acts = 0
    while acts < n_acts:
        a = choose(policy, rng, env)
        bricks_before = int(np.count_nonzero(env.env.brick_map))
        was_terminal = env.env.terminal
        prev = env.last_action
        r, t = env.act(a)
        acts += 1
        draws = rec.take()
        if draws[0][1] < sticky * 2.0**53 and a != prev:
            stats["sticky_repeats"] += 1
        if int(np.count_nonzero(env.env.brick_map)) > bricks_before:
            stats["brick_refills"] += 1
        if env.env.brick_map[env.env.ball_y, env.env.ball_x]:
            # A brick hit on the step after a hit is not counted: the ball enters the brick.
            stats["ball_on_brick"] += 1
        events.append({"op": "act", "action": a, "taken": int(env.last_action), "draws": draws,
                       "reward": int(r),
                       "terminal": bool(t), "state": pack_state(env.state())})
        ret += r
        stats["rewards"] += int(r)
        stats["max_return"] = max(stats["max_return"], ret)
        if was_terminal:
            stats["acts_after_terminal"] += 1
        if t and not was_terminal:
            stats["terminals"] += 1
            extra = int(rng.randint(1, 4)) if rng.rand() < P_ACT_AFTER_TERMINAL else 0
            for _ in range(extra):
                if acts >= n_acts:
                    break
                a = int(rng.randint(6))
                r, t = env.act(a)
                acts += 1
                assert r == 0 and t
                stats["acts_after_terminal"] += 1
                events.append({"op": "act", "action": a, "taken": int(env.last_action),
                               "draws": rec.take(), "reward": int(r), "terminal": bool(t),
                               "state": pack_state(env.state())})
            if acts < n_acts:
                reset()
                ret = 0
        elif not t and rng.rand() < p_truncate and acts < n_acts:
            stats["truncations"] += 1
            reset()
            ret = 0
    return {"seed": seed, "sticky_action_prob": sticky, "policy": policy,
            "policy_seed": policy_seed, "truncate_prob": p_truncate, "stats": stats, "events": events}


def reference_return(actions, episodes, seed):
    env = Environment("breakout")
    env.seed(seed)
    rng = np.random.RandomState(seed + 1)
    rets = np.zeros(episodes)
    steps = 0
    for e in range(episodes):
        env.reset()
        t = False
        while not t:
            r, t = env.act(int(actions[rng.randint(len(actions))]))
            rets[e] += r
            steps += 1
    return {"env_seed": seed, "policy_seed": seed + 1,
            "policy": "action = actions[RandomState(policy_seed).randint(len(actions))]",
            "actions": [int(a) for a in actions], "episodes": episodes,
            "total_return": int(rets.sum()), "total_steps": steps,
            "mean_return": float(rets.mean()),
            "std_error": float(rets.std(ddof=1) / np.sqrt(episodes)),
            "mean_length": steps / episodes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--any-version", action="store_true",
                    help=f"record with an installed minatar other than {MINATAR_VERSION}")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    version = importlib.metadata.version("minatar")
    if version != MINATAR_VERSION and not args.any_version:
        sys.exit(f"minatar {version} is installed; these recordings pin {MINATAR_VERSION} "
                 f"(pip install minatar=={MINATAR_VERSION}, or pass --any-version)")

    env = Environment("breakout")
    data = {
        "game": "breakout",
        "minatar_version": version,
        "numpy_version": np.__version__,
        "generator": "scripts/record_minatar.py",
        "num_actions": env.num_actions(),
        "minimal_action_set": [int(a) for a in env.minimal_action_set()],
        "state_shape": list(env.state_shape()),
        "state_encoding": "np.packbits(state.reshape(-1)).tobytes().hex(), state (10, 10, 4) "
                          "bool, channels paddle, ball, trail, brick",
        "draw_encoding": "[\"rand\", k]: rand() == k / 2**53; [\"randint\", n, v]: randint(n) == v",
        "trajectories": [record(*t) for t in TRAJECTORIES],
        "random_policy": [
            reference_return(list(range(6)), REFERENCE_EPISODES, 1),
            reference_return(env.minimal_action_set(), REFERENCE_EPISODES, 2),
        ],
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    raw = json.dumps(data, separators=(",", ":")).encode()
    with open(args.out, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
            gz.write(raw)
    for t in data["trajectories"]:
        print(f"seed {t['seed']:>10} {t['policy']:<13} p={t['sticky_action_prob']}: "
              f"{len(t['events'])} events, {t['stats']}")
    for r in data["random_policy"]:
        print(f"random policy over {r['actions']}: mean return {r['mean_return']:.4f} "
              f"+- {r['std_error']:.4f} ({r['episodes']} episodes, mean length "
              f"{r['mean_length']:.2f})")
    print(f"wrote {args.out}: {os.path.getsize(args.out)} bytes ({len(raw)} uncompressed)")


if __name__ == "__main__":
    main()
