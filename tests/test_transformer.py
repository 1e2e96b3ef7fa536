"""The causal transformer: pieces equal the whole, causality, seeding, bad inputs, MACs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lab.device import seeded
from lab.models.transformer import Transformer, language_model_loss


def _model(seed=0, **kw):
    args = dict(vocab_size=13, max_len=10, d_model=16, n_layers=3, n_heads=4, mlp_ratio=2,
                dtype=torch.float64)
    args.update(kw)
    with seeded(seed):
        return Transformer(**args)


def _tokens(B=3, T=10, V=13, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_pieces_compose_to_the_forward_pass():
    model, idx = _model(), _tokens()
    z = model.embed(idx)
    assert z.shape == (3, 10, 16)
    for block in model.blocks:
        z = block(z)
        assert z.shape == (3, 10, 16)
    logits = model.readout(z)
    assert logits.shape == (3, 10, 13)
    torch.testing.assert_close(logits, model(idx), rtol=0, atol=0)


def test_embedding_is_token_plus_position():
    model, idx = _model(), _tokens()
    expected = model.tok.weight[idx] + model.pos.weight[: idx.shape[1]][None]
    torch.testing.assert_close(model.embed(idx), expected, rtol=0, atol=0)


def test_attention_is_causal():
    """Changing token t changes no logit before t, and does change logits from t on."""
    model, idx = _model(), _tokens()
    t = 6
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 13
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-12)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-3


def test_attention_matches_a_direct_masked_softmax():
    model = _model()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q, k, v = attn.qkv(x).split(16, dim=2)
    heads = lambda t: t.view(2, 5, 4, 4).transpose(1, 2)  # noqa: E731  (B, H, T, D/H)
    scores = heads(q) @ heads(k).transpose(-1, -2) / 2.0  # sqrt(D/H) = 2
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    weights = scores.masked_fill(mask, float("-inf")).softmax(-1)
    direct = attn.proj((weights @ heads(v)).transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(attn(x), direct, rtol=1e-10, atol=1e-12)


def test_seed_fixes_initialisation_without_touching_global_rng():
    before = torch.random.get_rng_state()
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    assert torch.equal(torch.random.get_rng_state(), before)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name


def test_initial_scales():
    model = _model(d_model=64, vocab_size=200, n_layers=4, dtype=torch.float32)
    assert model.tok.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # Residual-stream projections shrink with depth: 0.02 / sqrt(2 L).
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 8 ** 0.5,
                                                                         rel=0.05)
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(64))
    assert torch.equal(model.blocks[0].ln1.bias, torch.zeros(64))


def test_initial_loss_is_near_uniform():
    model, idx = _model(), _tokens()
    loss = language_model_loss(model(idx), _tokens(seed=2))
    assert loss.item() == pytest.approx(torch.log(torch.tensor(13.0)).item(), rel=0.1)


def test_sequence_beyond_position_table_is_refused():
    model = _model(max_len=10)
    with pytest.raises(ValueError, match=r"sequence length 11 is beyond the position table "
                                         r"\(max_len=10\)"):
        model.embed(_tokens(T=11))
    with pytest.raises(ValueError, match="beyond the position table"):
        model(_tokens(T=11))


@pytest.mark.parametrize("kw, message", [
    (dict(n_layers=0), r"n_layers=0 is not allowed"),
    (dict(d_model=18, n_heads=4), r"d_model=18 is not divisible by n_heads=4"),
])
def test_bad_architecture_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _model(**kw)


def test_block_macs_match_the_linear_layers():
    """The per-token dense count equals the Linear layers' in x out; attention adds (T+1) D."""
    model, T = _model(), 10
    dense = sum(m.in_features * m.out_features for m in model.blocks[0].modules()
                if isinstance(m, nn.Linear))
    assert model.block_macs(T) == dense + (T + 1) * 16
    assert model.readout_macs() == 16 * 13
