"""A plain multilayer perceptron with the same population/tap contract as the ResNet.

Hidden populations are the post-ReLU activations; every weight sits in a
``lab.models.layers.Linear``, so every learning rule applies unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import Linear, local_layers


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: tuple[int, ...], n_classes: int,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        sizes = (in_features, *hidden)
        self.hidden = nn.ModuleList(Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.fc = Linear(sizes[-1], n_classes)
        self.population_names = [f"hidden{i}" for i in range(len(hidden))]
        self.to(dtype)

    def forward(self, x: torch.Tensor, tap=None) -> torch.Tensor:
        h = x.flatten(1)  # (B, in_features)
        for i, layer in enumerate(self.hidden):
            h = F.relu(layer(h))
            h = tap(i, h) if tap else h
        return self.fc(h)  # (B, n_classes)

    def layer_macs(self, example_shape) -> dict[str, int]:
        return {name: m.in_features * m.out_features for name, m in self.layers}

    @property
    def layers(self):
        return local_layers(self)
