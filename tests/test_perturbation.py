"""The shared perturbation estimator against autograd (float64) and against forward hooks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lab.models.layers import Conv, local_layers
from lab.models.resnet import ResNet
from lab.rules.perturbation import PerturbationEstimator, forward_from, layers_above

B, L = 4, 8


def smooth_net(normalization="none", seed=0):
    """A tiny float64 ResNet whose loss is differentiable at the test point.

    Conv biases start at zero, so a unit whose receptive field is all zeros
    (frequent at width 2) sits exactly on its ReLU's kink: the loss has no
    derivative there and a central difference sees half the kink. Random
    biases move every pre-activation off zero.
    """
    torch.manual_seed(seed)
    model = ResNet(depth=8, width=2, dims=1, in_channels=1, n_classes=3,
                   normalization=normalization, dtype=torch.float64)
    with torch.no_grad():
        for _, m in local_layers(model):
            if m.bias is not None:
                m.bias.normal_(0.0, 0.3)
    x = torch.randn(B, 1, L, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 1])
    return model, x, y


def true_gradients(model, x, y):
    hs = []
    logits = model(x, tap=lambda i, h: hs.append(h) or h)
    loss = F.cross_entropy(logits, y, reduction="sum")
    return [h.detach() for h in hs], [g.detach() for g in torch.autograd.grad(loss, hs)], loss


def estimator(model, **kw):
    kw = {"sigma": 1e-5, "directions": 8, "generator": torch.Generator().manual_seed(1), **kw}
    return PerturbationEstimator(model, **kw)


def below(hs, i):
    return hs[i - 1] if i % 2 else None


def cos(a, b):
    return float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("normalization", ["none", "batchnorm"])
def test_forward_from_reproduces_the_full_forward(normalization):
    model, x, _ = smooth_net(normalization)
    model.train()
    hs = []
    with torch.no_grad():
        logits = model(x, tap=lambda i, h: hs.append(h) or h)
        for i, h in enumerate(hs):
            assert torch.equal(forward_from(model, i, h, below(hs, i)), logits), i


def test_gaussian_estimate_is_unbiased_in_direction_and_magnitude():
    """Many N(0, I) directions: mean_k o_k xi_k -> autograd's gradient (cos and norm)."""
    model, x, y = smooth_net()
    hs, grads, _ = true_gradients(model, x, y)
    d = hs[0].numel()  # 64 at every population of this net
    k = 240 * d
    est = estimator(model, directions=k, chunk=2048)
    for i in (0, 3, 6):  # the stem, an inner population (shortcut below), the last one
        g = est.observe(i, hs[i], y, below=below(hs, i)).estimate()
        # E||estimate||^2 = ||g||^2 (1 + (D + 1) / K): cos ~ 0.998, ratio ~ 1.002, and the
        # ratio's sampling sd is about sqrt(2 / K) = 0.011: 0.05 is over 4 sd.
        assert cos(g, grads[i]) > 0.99, i
        assert g.norm() / grads[i].norm() == pytest.approx(1.0, abs=0.05), i


@pytest.mark.parametrize("normalization", ["none", "batchnorm"])
def test_a_complete_orthogonal_set_reconstructs_the_gradient_exactly(normalization):
    """D orthogonal directions of norm sqrt(D): the estimate is the gradient itself.

    With batch norm too: the observed scalar is the batch's summed loss, so it
    carries the coupling of examples through the batch statistics.
    """
    model, x, y = smooth_net(normalization)
    model.train()
    hs, grads, _ = true_gradients(model, x, y)
    # With batch norm each direction is its own pass (no stacking): three populations.
    for i in range(len(hs)) if normalization == "none" else (0, 3, 6):
        h = hs[i]
        est = estimator(model, directions=h.numel(), basis="orthogonal")
        probe = est.observe(i, h, y, below=below(hs, i))
        assert (probe.estimate() - grads[i]).norm() / grads[i].norm() < 1e-7, i
        # The regression gradient mean_k (<t, xi_k> - o_k) xi_k is then t - g exactly.
        t = torch.randn_like(h)
        assert torch.allclose(probe.residual(t), t - grads[i], rtol=0, atol=1e-7)


def test_difference_bias_orders():
    """Forward differences err O(sigma), central ones O(sigma^2)."""
    model, x, y = smooth_net()
    hs, grads, loss = true_gradients(model, x, y)
    i, d = 2, hs[2].numel()
    errors = {}
    for difference in ("forward", "central"):
        for sigma in (1e-3, 1e-4):  # small enough that no ReLU crosses its kink
            est = estimator(model, sigma=sigma, directions=d, basis="orthogonal",
                            difference=difference)
            g = est.observe(i, hs[i], y, loss.detach(), below(hs, i)).estimate()
            errors[difference, sigma] = float((g - grads[i]).norm())
    assert errors["forward", 1e-3] / errors["forward", 1e-4] == pytest.approx(10, rel=0.2)
    assert errors["central", 1e-3] / errors["central", 1e-4] == pytest.approx(100, rel=0.2)


def test_orthogonal_directions_are_orthogonal_with_norm_sqrt_d():
    model, x, _ = smooth_net()
    like = torch.zeros(B, 2, L, dtype=torch.float64)
    d = like.numel()
    xi = estimator(model, basis="orthogonal").draw(like, d + 5).flatten(1)  # (d + 5, d)
    gram = xi[:d] @ xi[:d].T
    assert torch.allclose(gram, d * torch.eye(d, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(xi[d:].norm(dim=1), torch.full((5,), math.sqrt(d),
                                                         dtype=torch.float64))


def test_same_generator_same_directions():
    model, x, y = smooth_net()
    hs, _, _ = true_gradients(model, x, y)
    a = estimator(model).observe(3, hs[3], y, below=hs[2])
    b = estimator(model).observe(3, hs[3], y, below=hs[2])
    assert torch.equal(a.directions, b.directions)
    assert torch.equal(a.observations, b.observations)


@pytest.mark.parametrize("difference, per_query", [("central", 2), ("forward", 1)])
@pytest.mark.parametrize("normalization", ["none", "batchnorm"])
def test_bill_counts_every_perturbed_pass_against_hooks(difference, per_query, normalization):
    """MACs from forward hooks during one event = the estimator's bill; counts per query."""
    model, x, y = smooth_net(normalization)
    model.train()
    hs, _, loss = true_gradients(model, x, y)
    counted = {"macs": 0}

    def hook(module, inputs, output):
        per_output = (module.in_channels * math.prod(module.kernel_size)
                      if isinstance(module, Conv) else module.in_features)
        counted["macs"] += output.numel() * per_output

    handles = [m.register_forward_hook(hook) for _, m in local_layers(model)]
    k = 5
    est = estimator(model, directions=k, difference=difference, chunk=2)
    try:
        for i, h in enumerate(hs):
            est.observe(i, h, y, loss.detach(), below(hs, i))
    finally:
        for handle in handles:
            handle.remove()
    layer_macs = model.layer_macs((1, L))
    assert est.macs(layer_macs) == counted["macs"]
    assert est.loss_queries == len(hs) * k * per_query
    assert est.observations == est.loss_queries  # one batch-loss scalar per query
    assert est.counts()["example_passes"] == len(hs) * k * per_query * B
    # Only the layers above are re-run: the stem is never billed, fc always.
    assert all("stem" not in layers_above(model, i) for i in range(len(hs)))
    assert layers_above(model, 1)[0] == "blocks.0.conv2"


def test_per_example_observations_count_one_scalar_per_example():
    model, x, y = smooth_net()
    hs, grads, _ = true_gradients(model, x, y)
    est = estimator(model, directions=3, per_example=True)
    probe = est.observe(6, hs[6], y, below=None)
    assert probe.observations.shape == (3, B)
    assert est.observations == 2 * 3 * B
    # Without batch norm an example's loss depends on its own activity only: the
    # per-example estimate has the gradient's expectation, example by example.
    est = estimator(model, directions=4000, per_example=True, chunk=4000)
    g = est.observe(6, hs[6], y, below=None).estimate()
    assert cos(g, grads[6]) > 0.97


@pytest.mark.parametrize("kw, message", [
    ({"difference": "back"}, r"difference='back' is not allowed; choose from \('central', "),
    ({"basis": "sobol"}, r"basis='sobol' is not allowed; choose from \('gaussian', "),
    ({"sigma": 0.0}, r"sigma=0.0 must be > 0"),
    ({"directions": 0}, r"directions=0 .* at least 1"),
])
def test_bad_estimator_arguments(kw, message):
    model, _, _ = smooth_net()
    with pytest.raises(ValueError, match=message):
        estimator(model, **kw)


def test_forward_differences_need_the_clean_loss():
    model, x, y = smooth_net()
    hs, _, _ = true_gradients(model, x, y)
    with pytest.raises(ValueError, match="forward differences need the clean loss"):
        estimator(model, difference="forward").observe(0, hs[0], y)


def test_estimator_needs_a_resnet():
    with pytest.raises(ValueError, match="needs a lab.models.ResNet.*got Linear"):
        estimator(torch.nn.Linear(2, 2))
