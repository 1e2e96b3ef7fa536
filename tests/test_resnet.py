"""ResNet structure, populations, and the feedback slot of its layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.models import Conv, Linear, ResNet


def _input(dims, batch=3, channels=2, dtype=torch.float64):
    shape = (batch, channels, 16) if dims == 1 else (batch, channels, 8, 8)
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("depth", [8, 14, 20])
def test_layers_and_populations(dims, depth):
    model = ResNet(depth, 4, dims=dims, in_channels=2, n_classes=5, dtype=torch.float64)
    assert len(model.layers) == depth  # 6n+1 convolutions and the read-out
    seen = []
    logits = model(_input(dims), tap=lambda i, h: seen.append((i, h.shape)) or h)
    assert logits.shape == (3, 5)
    assert [i for i, _ in seen] == list(range(6 * ((depth - 2) // 6) + 1))
    assert len(model.population_names) == len(seen)
    widths = [shape[1] for _, shape in seen]
    assert widths[0] == 4 and widths[-1] == 16  # w ... 4w
    assert all(len(shape) == dims + 2 for _, shape in seen)


@pytest.mark.parametrize("kwargs, message", [
    (dict(depth=10), "6n\\+2"), (dict(dims=3), "dims=3"), (dict(normalization="ln"), "'ln'")])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ResNet(**kwargs)


@pytest.mark.parametrize("dims", [1, 2])
def test_tap_replaces_populations(dims):
    model = ResNet(8, 4, dims=dims, in_channels=2, dtype=torch.float64)
    x = _input(dims)
    zeroed = model(x, tap=lambda i, h: torch.zeros_like(h) if i == len(model.population_names) - 1
                   else h)
    # A zero last population leaves only the read-out bias.
    assert torch.allclose(zeroed, model.fc.bias.expand_as(zeroed))


@pytest.mark.parametrize("normalization", ["batchnorm", "none"])
def test_dtype_and_normalization(normalization):
    model = ResNet(8, 4, dims=2, in_channels=2, normalization=normalization,
                   dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert model(_input(2)).dtype == torch.float64


def _layer(kind, dims=2):
    if kind == "linear":
        return Linear(6, 5).double(), torch.randn(4, 6, dtype=torch.float64)
    layer = Conv(dims, 3, 5, 3, stride=2, padding=1, bias=True).double()
    shape = (4, 3, 9) if dims == 1 else (4, 3, 9, 9)
    return layer, torch.randn(*shape, dtype=torch.float64)


KINDS = [("linear", 2), ("conv", 1), ("conv", 2)]


def _grads(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    layer(x).backward(grad_out)
    return x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("kind, dims", KINDS)
def test_feedback_equal_to_weight_gives_autograd(kind, dims):
    layer, x = _layer(kind, dims)
    grad_out = torch.randn_like(layer(x))
    expected = _grads(layer, x, grad_out)
    layer.feedback = layer.weight.detach().clone()
    for got, want in zip(_grads(layer, x, grad_out), expected):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind, dims", KINDS)
def test_feedback_carries_the_input_gradient(kind, dims):
    layer, x = _layer(kind, dims)
    grad_out = torch.randn_like(layer(x))
    clean = _grads(layer, x, grad_out)
    feedback = torch.randn_like(layer.weight)
    layer.feedback = feedback
    grad_x, grad_w, grad_b = _grads(layer, x, grad_out)
    # The input gradient is what autograd gives for a layer whose weight is B ...
    probe = x.clone().requires_grad_(True)
    if kind == "linear":
        out = F.linear(probe, feedback)
    else:
        conv = F.conv1d if dims == 1 else F.conv2d
        out = conv(probe, feedback, None, layer.stride, layer.padding)
    out.backward(grad_out)
    assert torch.allclose(grad_x, probe.grad, atol=1e-12, rtol=0)
    # ... while the weight and bias gradients stay the local correlations.
    assert torch.allclose(grad_w, clean[1], atol=1e-12, rtol=0)
    assert torch.allclose(grad_b, clean[2], atol=1e-12, rtol=0)
