#!/usr/bin/env python3
"""Writes the PyTorch import fixture of tests/pytorch_import.rs into tests/data/pytorch/.

The model is what this PyTorch code describes (it is not run; PyTorch is not needed):

    model = nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=(3, 5), stride=(1, 2), padding=(1, 2)),  # features.0
        nn.BatchNorm2d(8, eps=1e-3),                                          # features.1
        nn.ReLU(),                                                            # features.2
        nn.Conv2d(8, 4, kernel_size=3, stride=2, bias=True),                  # features.3
    )
    model.eval()
    safetensors.torch.save_file(model.state_dict(), "conv_bn_relu_conv.safetensors")

Outputs:

- conv_bn_relu_conv.safetensors: the state dict as PyTorch's save_file writes it: PyTorch's
  names, float32, Conv2d weights OIHW [out, in, kh, kw], BatchNorm2d weight, bias,
  running_mean, running_var (random, not the defaults, so that the import of each is tested)
  and num_batches_tracked (int64, a 0-d tensor; the import ignores it).
- conv_bn_relu_conv_io.safetensors: `input` (float32, NCHW [2, 3, 7, 9]) and the eval-mode
  outputs computed here in float64 with plain numpy from those same float32 values:
  `features.2` (after conv, BatchNorm with running statistics and eps, ReLU; NCHW
  [2, 8, 7, 5]) and `features.3` (the second conv; NCHW [2, 4, 3, 2]).

Non-square kernel, stride and padding make a swapped axis show; eps 1e-3 (not the default)
makes an ignored eps show.

Regenerate (deterministic):

    pip install numpy safetensors
    python3 scripts/make_pytorch_fixture.py
"""

import os

import numpy as np
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "pytorch")
EPS = 1e-3


def conv2d(x, w, b, stride, padding):
    """PyTorch's Conv2d (cross-correlation) in float64: x NCHW, w OIHW, zero padding."""
    n, c, h, wd = x.shape
    o, i, kh, kw = w.shape
    assert i == c
    (sh, sw), (ph, pw) = stride, padding
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph : ph + h, pw : pw + wd] = x
    oh = (h + 2 * ph - kh) // sh + 1
    ow = (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((n, o, oh, ow))
    for r in range(oh):
        for q in range(ow):
            patch = xp[:, :, r * sh : r * sh + kh, q * sw : q * sw + kw]  # [n, c, kh, kw]
            y[:, :, r, q] = np.einsum("nchw,ochw->no", patch, w) + b
    return y


def batchnorm_eval(x, weight, bias, mean, var, eps):
    """BatchNorm2d in eval(): the stored running statistics, used as they are."""
    shape = (1, -1, 1, 1)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * weight.reshape(
        shape
    ) + bias.reshape(shape)


def main():
    rng = np.random.default_rng(20240611)
    f32 = np.float32

    def uniform(shape, bound):
        return rng.uniform(-bound, bound, size=shape).astype(f32)

    # PyTorch's default init bounds (1/sqrt(fan_in)), for realistic magnitudes.
    state = {
        "features.0.weight": uniform((8, 3, 3, 5), 1 / np.sqrt(3 * 3 * 5)),
        "features.0.bias": uniform((8,), 1 / np.sqrt(3 * 3 * 5)),
        "features.1.weight": (1 + 0.5 * rng.standard_normal(8)).astype(f32),
        "features.1.bias": (0.2 * rng.standard_normal(8)).astype(f32),
        "features.1.running_mean": (0.3 * rng.standard_normal(8)).astype(f32),
        "features.1.running_var": rng.uniform(0.05, 0.5, size=8).astype(f32),
        "features.1.num_batches_tracked": np.array(100, dtype=np.int64),
        "features.3.weight": uniform((4, 8, 3, 3), 1 / np.sqrt(8 * 3 * 3)),
        "features.3.bias": uniform((4,), 1 / np.sqrt(8 * 3 * 3)),
    }
    x = rng.standard_normal((2, 3, 7, 9)).astype(f32)

    p = {k: v.astype(np.float64) for k, v in state.items()}
    z = conv2d(x.astype(np.float64), p["features.0.weight"], p["features.0.bias"], (1, 2), (1, 2))
    z = batchnorm_eval(
        z,
        p["features.1.weight"],
        p["features.1.bias"],
        p["features.1.running_mean"],
        p["features.1.running_var"],
        EPS,
    )
    h = np.maximum(z, 0.0)
    y = conv2d(h, p["features.3.weight"], p["features.3.bias"], (2, 2), (0, 0))
    assert h.shape == (2, 8, 7, 5) and y.shape == (2, 4, 3, 2), (h.shape, y.shape)

    os.makedirs(OUT, exist_ok=True)
    # HF's PyTorch writers add this metadata; the import does not need it.
    save_file(state, os.path.join(OUT, "conv_bn_relu_conv.safetensors"), metadata={"format": "pt"})
    save_file(
        {"input": x, "features.2": h, "features.3": y},
        os.path.join(OUT, "conv_bn_relu_conv_io.safetensors"),
    )
    print(f"wrote {os.path.normpath(OUT)}: relu range [{h.min():.3f}, {h.max():.3f}], "
          f"{(h > 0).mean():.0%} positive; output range [{y.min():.3f}, {y.max():.3f}]")


if __name__ == "__main__":
    main()
