"""ResNet structure, populations, and the feedback slot of its layers."""

from __future__ import annotations

import copy
import io

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


def _reference_forward(model, x):
    """He et al. 2016's CIFAR ResNet written out with functional ops and the model's weights.

    Training-mode batch norm (batch statistics, the model's affine), option-A
    shortcuts (subsample, zero-pad channels), global average pool, read-out.
    """
    dims = model.dims
    conv = F.conv1d if dims == 1 else F.conv2d

    def norm(module, h):
        if isinstance(module, torch.nn.Identity):
            return h
        axes = [0] + list(range(2, h.ndim))
        mean = h.mean(axes, keepdim=True)
        var = h.var(axes, unbiased=False, keepdim=True)
        shape = [1, -1] + [1] * dims
        return ((h - mean) / torch.sqrt(var + module.eps) * module.weight.view(shape)
                + module.bias.view(shape))

    def layer(c, h):
        return conv(h, c.weight, c.bias, c.stride, c.padding)

    h = F.relu(norm(model.stem_norm, layer(model.stem, x)))
    for block in model.blocks:
        inner = F.relu(norm(block.norm1, layer(block.conv1, h)))
        s = block.stride
        short = h[:, :, ::s] if dims == 1 else h[:, :, ::s, ::s]
        pad = torch.zeros(short.shape[0], block.pad_channels, *short.shape[2:], dtype=h.dtype)
        short = torch.cat([short, pad], 1)
        h = F.relu(block.residual_scale * norm(block.norm2, layer(block.conv2, inner)) + short)
    return h.flatten(2).mean(2) @ model.fc.weight.t() + model.fc.bias


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("normalization, residual_scale", [("batchnorm", 1.0), ("none", 0.5)])
def test_forward_matches_a_functional_reference(dims, normalization, residual_scale):
    torch.manual_seed(0)
    model = ResNet(14, 4, dims=dims, in_channels=2, normalization=normalization,
                   residual_scale=residual_scale, dtype=torch.float64)
    with torch.no_grad():  # non-trivial affine and bias so each term is tested
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, Conv) and m.bias is not None:
                m.bias.uniform_(-0.5, 0.5)
    convs = [m for m in model.modules() if isinstance(m, Conv)]
    assert all((m.bias is None) == (normalization == "batchnorm") for m in convs)
    model.train()
    x = _input(dims, batch=5)
    out = model(x)
    assert out.dtype == torch.float64
    assert torch.allclose(out, _reference_forward(model, x), atol=1e-12, rtol=0)


def test_float32_model_computes_the_float64_function():
    torch.manual_seed(0)
    model = ResNet(8, 4, dims=2, in_channels=2, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    double = copy.deepcopy(model).double()
    x = _input(2, batch=5)
    out = model(x.float())
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), double(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, dims", [("linear", 2), ("conv", 1), ("conv", 2)])
def test_copies_do_not_inherit_a_feedback_tensor(kind, dims):
    """deepcopy (a backprop twin) and pickling leave the feedback slot behind."""
    layer, x = _layer(kind, dims)
    layer.feedback = torch.randn_like(layer.weight)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert twin.feedback is None and layer.feedback is not None
        assert torch.equal(twin.weight, layer.weight)
        grad_out = torch.randn_like(layer(x))
        layer.feedback = None
        expected = _grads(layer, x, grad_out)
        for got, want in zip(_grads(twin, x, grad_out), expected):
            assert torch.equal(got, want)
        layer.feedback = torch.randn_like(layer.weight)


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
