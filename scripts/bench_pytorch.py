#!/usr/bin/env python3
"""Times PyTorch (CPU, f32, channels_last) on the shapes of `examples/bench.rs`.

An optional tool, not part of CI: it needs `torch` (`pip install torch`). For each thread count
of `--threads` (`torch.set_num_threads(N)`), each shape runs as the bench's layer does: the
convolution with its bias and activation, and BatchNorm where the bench's row has it:

- `evaluate` at batch 1 and at the training batch (the bench's `eval_batches`), in eval mode
  (BatchNorm with its running statistics) under `torch.inference_mode()`;
- `train_step` at the training batch: forward in training mode (batch statistics) and backward
  from a fixed output gradient (the gradient of `sum(y * d_output)`), producing the input's and
  every parameter's gradient. Parameter gradients accumulate between steps, as in the bench.

Timing follows the bench: a warm-up of a quarter of a repetition that also sets how many calls
fill one repetition, then the median (and fastest) of the repetitions. FLOPs are the bench's
direct-convolution count (2 * B * OH * OW * OC * KH * KW * IC per forward, 3x for a training
step). Output: a table, then one line per result with the bench's field names:

    BENCH_JSON {"backend":"pytorch","shape":"nature1","op":"evaluate","batch":1,"dtype":"f32",
                "threads":1,"us":...,"us_min":...,"flops":...,"gflops":...}

and, with several counts, `BENCH_SCALING` lines (speedup over the first count) as the bench
prints them.

    python3 scripts/bench_pytorch.py [FILTER] [--threads 1,2] [--quick]

With `--networks`, the whole networks of `examples/bench_networks.rs` instead (the Nature DQN,
the IMPALA CNN, MinAtar's DQN, as `nn.Sequential`, channels_last): `act` is one action
(`evaluate` at batch 1, inference mode), `evaluate` the same at batch 32 (a target network's
pass), `train_step` forward, backward from a fixed output gradient and one Adam step at batch
32, printing `BENCH_JSON` lines with that example's fields.
"""

import argparse
import json
import sys
import time

# The bench's suite (examples/bench.rs): name, input [H, W, C], output channels, kernel, stride,
# padding, activation, BatchNorm, training batch, evaluate batches.
SHAPES = [
    ("nature1", (84, 84, 4), 32, 8, 4, 0, "relu", False, 32, (1, 32)),
    ("nature2", (20, 20, 32), 64, 4, 2, 0, "relu", False, 32, (1, 32)),
    ("nature3", (9, 9, 64), 64, 3, 1, 0, "relu", False, 32, (1, 32)),
    ("cifar1", (32, 32, 3), 16, 3, 1, 1, "relu", False, 32, (1, 32)),
    ("bn16", (16, 16, 16), 32, 3, 2, 1, "relu", False, 32, (1, 32)),
    ("tiny", (8, 8, 1), 8, 3, 1, 1, "tanh", False, 32, (1, 32)),
    ("resnet", (56, 56, 64), 64, 3, 1, 1, "relu", False, 8, (1, 8)),
    ("nature2_bn", (20, 20, 32), 64, 4, 2, 0, "relu", True, 32, (32,)),
    ("bn16_bn", (16, 16, 16), 32, 3, 2, 1, "relu", True, 32, (32,)),
]


def parse_counts(text):
    counts = []
    for item in text.split(","):
        n = int(item)
        if n <= 0:
            raise ValueError(item)
        if n not in counts:
            counts.append(n)
    return counts


def measure(target, repetitions, f):
    """Seconds per call of `f`, one sample per repetition (the bench's `measure`)."""
    start = time.perf_counter()
    calls = 0
    while calls < 2 or time.perf_counter() - start < target / 4:
        f()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    iterations = max(1, round(target / per_call))
    samples = []
    for _ in range(repetitions):
        start = time.perf_counter()
        for _ in range(iterations):
            f()
        samples.append((time.perf_counter() - start) / iterations)
    return samples


def layer(torch, ic, oc, k, s, p, activation, batch_norm):
    modules = [torch.nn.Conv2d(ic, oc, k, stride=s, padding=p, bias=True)]
    if batch_norm:
        modules.append(torch.nn.BatchNorm2d(oc, eps=1e-5, momentum=0.1))
    modules.append(torch.nn.ReLU() if activation == "relu" else torch.nn.Tanh())
    return torch.nn.Sequential(*modules).to(memory_format=torch.channels_last)


class Residual:
    """`x + f(x)` as an `nn.Sequential` whose forward adds its input (the layout
    `import_pytorch_network` reads), built lazily so that `torch` is imported only when present."""

    @staticmethod
    def make(torch, *layers):
        class Block(torch.nn.Sequential):
            def forward(self, x):
                return x + super().forward(x)

        return Block(*layers)


def networks(torch):
    """The networks of examples/bench_networks.rs: name, input [H, W, C], model."""
    nn = torch.nn

    def impala_stack(ic, oc):
        def block():
            return Residual.make(torch, nn.ReLU(), nn.Conv2d(oc, oc, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(oc, oc, 3, padding=1))
        return [nn.Conv2d(ic, oc, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), block(), block()]

    nature = nn.Sequential(
        nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3), nn.ReLU(), nn.Flatten(), nn.Linear(7 * 7 * 64, 512), nn.ReLU(),
        nn.Linear(512, 6))
    impala = nn.Sequential(
        *impala_stack(3, 16), *impala_stack(16, 32), *impala_stack(32, 32), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 8 * 32, 256), nn.ReLU(), nn.Linear(256, 15))
    minatar = nn.Sequential(
        nn.Conv2d(4, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 16, 128), nn.ReLU(),
        nn.Linear(128, 3))
    return [("nature_dqn", (84, 84, 4), nature), ("impala", (64, 64, 3), impala),
            ("minatar_dqn", (10, 10, 4), minatar)]


def bench_networks(torch, args, target, repetitions):
    print(f"{'network':<13} {'op':<11} {'batch':>5} {'threads':>7} {'us/call':>12} {'spread':>7}")
    rows = []
    for name, (h, w, c), model in networks(torch):
        if args.filter and args.filter not in name:
            continue
        model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        for threads in args.threads:
            torch.set_num_threads(threads)

            def record(op, batch, f):
                samples = sorted(measure(target, repetitions, f))
                median = samples[len(samples) // 2]
                spread = (samples[-1] - samples[0]) / median
                print(f"{name:<13} {op:<11} {batch:>5} {threads:>7} {median * 1e6:>12.1f} "
                      f"{100 * spread:>6.1f}%", flush=True)
                rows.append({"network": name, "op": op, "batch": batch, "backend": "pytorch",
                             "threads": threads, "us": round(median * 1e6, 2),
                             "spread": round(spread, 4)})

            model.eval()
            x1 = torch.rand(1, c, h, w).contiguous(memory_format=torch.channels_last)

            def act():
                with torch.inference_mode():
                    model(x1).argmax(dim=1)

            record("act", 1, act)
            x = torch.rand(32, c, h, w).contiguous(memory_format=torch.channels_last)

            def evaluate():
                with torch.inference_mode():
                    model(x)

            record("evaluate", 32, evaluate)
            model.train()
            with torch.no_grad():
                d_output = torch.rand_like(model(x)).mul_(2).sub_(1).mul_(1e-3)

            def train_step():
                optimizer.zero_grad(set_to_none=False)
                model(x).backward(d_output)
                optimizer.step()

            record("train_step", 32, train_step)
    print()
    for row in rows:
        print("BENCH_JSON " + json.dumps(row, separators=(",", ":")))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("filter", nargs="?", help="keep only shapes whose name contains this")
    parser.add_argument("--threads", type=parse_counts, default=[1], help="e.g. 1,2")
    parser.add_argument("--quick", action="store_true", help="shorter, less precise timing")
    parser.add_argument("--networks", action="store_true",
                        help="the whole networks of examples/bench_networks.rs")
    args = parser.parse_args()

    try:
        import torch
    except ImportError:
        sys.exit("bench_pytorch: needs PyTorch (pip install torch)")

    target, repetitions = (0.05, 3) if args.quick else (0.3, 5)
    print(f"torch {torch.__version__}, oneDNN (mkldnn) "
          f"{'on' if torch.backends.mkldnn.is_available() else 'off'}; "
          f"timing: median of {repetitions} repetitions of ~{target:.2f} s each; "
          f"threads: {', '.join(map(str, args.threads))}\n")
    torch.manual_seed(42)
    if args.networks:
        return bench_networks(torch, args, target, repetitions)
    header = f"{'shape':<11} {'op':<13} {'batch':>5} {'thr':>3} {'MFLOP':>9} {'us/call':>11} " \
             f"{'spread':>7} {'GFLOP/s':>9}"
    print(header)
    rows = []
    # Each shape at every count in turn, so that its rows see the same machine state.
    for name, (ih, iw, ic), oc, k, s, p, act, bn, train_batch, eval_batches in SHAPES:
        if args.filter and args.filter not in name:
            continue
        for threads in args.threads:
            torch.set_num_threads(threads)
            oh, ow = (ih + 2 * p - k) // s + 1, (iw + 2 * p - k) // s + 1

            def flops(batch):
                return 2 * batch * oh * ow * oc * k * k * ic

            model = layer(torch, ic, oc, k, s, p, act, bn)

            def record(op, batch, work, f):
                samples = sorted(measure(target, repetitions, f))
                median = samples[len(samples) // 2]
                row = {
                    "backend": "pytorch", "shape": name, "op": op, "batch": batch,
                    "dtype": "f32", "threads": threads, "us": round(median * 1e6, 4),
                    "us_min": round(samples[0] * 1e6, 4), "flops": work,
                    "gflops": round(work / median / 1e9, 4),
                }
                spread = (samples[-1] - samples[0]) / median
                print(f"{name:<11} {op:<13} {batch:>5} {threads:>3} {work / 1e6:>9.2f} "
                      f"{median * 1e6:>11.2f} {100 * spread:>6.1f}% {row['gflops']:>9.2f}",
                      flush=True)
                rows.append(row)

            model.eval()
            for batch in eval_batches:
                x = torch.rand(batch, ic, ih, iw).mul_(2).sub_(1)
                x = x.contiguous(memory_format=torch.channels_last)

                def evaluate():
                    with torch.inference_mode():
                        model(x)

                record("evaluate", batch, flops(batch), evaluate)

            model.train()
            x = torch.rand(train_batch, ic, ih, iw).mul_(2).sub_(1)
            x = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
            d_output = torch.rand(train_batch, oc, oh, ow).mul_(2).sub_(1)
            d_output = d_output.contiguous(memory_format=torch.channels_last)

            def train_step():
                x.grad = None
                model(x).backward(d_output)

            record("train_step", train_batch, 3 * flops(train_batch), train_step)

    print()
    for row in rows:
        print("BENCH_JSON " + json.dumps(row, separators=(",", ":")))
    base, others = args.threads[0], args.threads[1:]
    scaling = []
    for row in rows:
        if row["threads"] not in others:
            continue
        for b in rows:
            if b["threads"] == base and all(b[f] == row[f] for f in ("shape", "op", "batch")):
                speedup = b["us"] / row["us"]
                scaling.append((row, speedup))
    if scaling:
        print(f"\nthread scaling (time at {base} thread{'' if base == 1 else 's'} / time at N)")
        print(f"{'shape':<11} {'op':<13} {'batch':>5} {'N':>3} {'pytorch':>8}")
        for row, speedup in scaling:
            print(f"{row['shape']:<11} {row['op']:<13} {row['batch']:>5} {row['threads']:>3} "
                  f"{speedup:>7.2f}x")
        for row, speedup in scaling:
            line = {
                "shape": row["shape"], "op": row["op"], "batch": row["batch"], "dtype": "f32",
                "backend": "pytorch", "threads": row["threads"], "base_threads": base,
                "speedup": round(speedup, 4),
                "efficiency": round(speedup * base / row["threads"], 4),
            }
            print("BENCH_SCALING " + json.dumps(line, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
