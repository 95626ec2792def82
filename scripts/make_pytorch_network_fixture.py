#!/usr/bin/env python3
"""Writes the whole-network PyTorch import fixture of tests/pytorch_import.rs.

The model is a PyTorch `nn.Sequential` mirroring the test's `network!` entry for entry
(`Residual` is an `nn.Sequential` whose forward adds its input), with every kind that has
tensors or changes their order:

    model = nn.Sequential(
        nn.Conv2d(3, 8, (3, 5), padding=(1, 2)),          # conv1          0
        nn.BatchNorm2d(8, eps=1e-3),                      #   its norm     1
        nn.ReLU(),                                        #   activation   2
        nn.MaxPool2d(2),                                  # pool           3
        Residual(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)),  # res        4 (4.1.weight)
        nn.AvgPool2d(3, stride=1, padding=1),             # avg            5
        nn.Flatten(),                                     # flat           6
        nn.Linear(8 * 4 * 3, 10),                         # fc             7
        nn.Tanh(),                                        #   activation   8
        nn.Linear(10, 3),                                 # out            9
    )

The 9x7 input (height 9, width 7) pools to a 4x3 map, so `fc` sees a non-square map whose
flattening differs between PyTorch's NCHW (c, h, w) and our NHWC (h, w, c).

Outputs, in tests/data/pytorch/:

- sequential.safetensors: `model.state_dict()` as `safetensors.torch.save_file` writes it
  (float32; BatchNorm's running statistics trained away from their defaults by a few forward
  passes in training mode; `num_batches_tracked` included, which the import ignores).
- sequential_renamed.safetensors: the same tensors under a custom module's names
  (`torso.conv`, `torso.bn`, `torso.block.conv`, `head.fc`, `head.out`), for the import's
  explicit module names.
- sequential_io.safetensors: `input` (float32, NCHW [2, 3, 9, 7]) and `output` ([2, 3]): the
  eval-mode output of the same model in float64 (`model.double()`, from the float32 values).

Regenerate (deterministic; needs PyTorch and safetensors):

    pip install torch safetensors
    python3 scripts/make_pytorch_network_fixture.py
"""

import os

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "pytorch")


class Residual(torch.nn.Sequential):
    """`x + f(x)`, f the children in order."""

    def forward(self, x):
        return x + super().forward(x)


def main():
    torch.manual_seed(7)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 8, (3, 5), padding=(1, 2)),
        nn.BatchNorm2d(8, eps=1e-3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        Residual(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)),
        nn.AvgPool2d(3, stride=1, padding=1),
        nn.Flatten(),
        nn.Linear(8 * 4 * 3, 10),
        nn.Tanh(),
        nn.Linear(10, 3),
    )
    with torch.no_grad():
        # Affine BatchNorm parameters away from 1 and 0, running statistics from data.
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
        model.train()
        for _ in range(3):
            model(torch.randn(4, 3, 9, 7) * 2.0 + 0.5)
    model.eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    os.makedirs(OUT, exist_ok=True)
    save_file(state, os.path.join(OUT, "sequential.safetensors"))

    renames = {"0.": "torso.conv.", "1.": "torso.bn.", "4.1.": "torso.block.conv.",
               "7.": "head.fc.", "9.": "head.out."}
    renamed = {}
    for name, value in state.items():
        for old, new in renames.items():
            if name.startswith(old):
                renamed[new + name[len(old):]] = value
    save_file(renamed, os.path.join(OUT, "sequential_renamed.safetensors"))

    x = torch.randn(2, 3, 9, 7)
    with torch.no_grad():
        y = model.double()(x.double())
    save_file({"input": x.contiguous(), "output": y.contiguous()},
              os.path.join(OUT, "sequential_io.safetensors"))


if __name__ == "__main__":
    main()
