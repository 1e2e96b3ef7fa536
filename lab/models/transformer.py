"""A small causal (decoder-only) transformer whose blocks can be called one at a time.

The architecture is GPT-2's pre-norm decoder (Radford et al. 2019, "Language models are
unsupervised multitask learners"; the layout of Karpathy's nanoGPT): a token embedding plus a
learned position embedding gives the state z0; L blocks each add causal self-attention
(Vaswani et al. 2017) and an MLP to a residual stream, both reading a LayerNorm of it; a final
LayerNorm and a linear read-out give the vocabulary logits.

Equilibrium propagation (``lab.train.ep``) relaxes every block's output state separately, so the
model exposes the pieces and not only the whole chain::

    z = model.embed(idx)          # (B, T) token ids -> z0 (B, T, D)
    z = model.blocks[l](z)        # f_l: (B, T, D) -> (B, T, D), for l = 0 .. L-1
    logits = model.readout(z)     # (B, T, D) -> (B, T, V)

and ``model(idx)`` is exactly that chain. Blocks are deterministic (no dropout): the energy EP
minimises compares each state with f_l of the state below, which must be the same function in
every phase. Build the model under ``lab.device.seeded(seed)``: parameters are drawn from the
global generator, as for the ResNet.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Embeddings start at unit scale (torch's nn.Embedding default), not GPT-2's 0.02: EP nudges
# the states by beta * n * dCE/dz, and LayerNorm's 1/std makes that gradient large on a tiny
# residual stream, so with 0.02 even beta = 1e-4 moves the states by ~0.5% at initialisation.
EMBED_STD = 1.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (t.view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D/H)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, d_model: int, mlp_ratio: int):
        super().__init__()
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.proj = nn.Linear(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """f_l(z) = z' + MLP(LN(z')) with z' = z + Attn(LN(z)): a pre-norm residual block."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, mlp_ratio)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        z = z + self.attn(self.ln1(z))
        return z + self.mlp(self.ln2(z))


class Transformer(nn.Module):
    """Token + position embedding, ``n_layers`` blocks, LayerNorm and read-out to logits."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int = 64, n_layers: int = 3,
                 n_heads: int = 4, mlp_ratio: int = 4, dtype: torch.dtype = torch.float32):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers={n_layers} is not allowed; a transformer needs >= 1 block")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}; "
                             "each head gets d_model / n_heads channels")
        self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, d_model
        self.n_heads, self.mlp_ratio = n_heads, mlp_ratio
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self._init_weights(n_layers)
        self.to(dtype)

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2's initialisation (N(0, 0.02) weights, zero biases, the projections that write
        # into the residual stream scaled by 1/sqrt(2L) so its variance does not grow with
        # depth), except the embeddings: see EMBED_STD.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1:  # LayerNorm gains
                nn.init.ones_(p)
            elif name in ("tok.weight", "pos.weight"):
                nn.init.normal_(p, 0.0, EMBED_STD)
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """z0 = token embedding + position embedding: (B, T) int64 -> (B, T, D)."""
        T = idx.shape[1]
        if T > self.max_len:
            raise ValueError(f"sequence length {T} is beyond the position table "
                             f"(max_len={self.max_len}); use sequences of at most "
                             f"{self.max_len} tokens or build the model with a larger max_len")
        pos = torch.arange(T, device=idx.device)
        return self.tok(idx) + self.pos(pos)[None]

    def readout(self, z: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and linear read-out: (B, T, D) -> logits (B, T, V)."""
        return self.head(self.ln_f(z))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        z = self.embed(idx)
        for block in self.blocks:
            z = block(z)
        return self.readout(z)

    def block_macs(self, seq_len: int) -> int:
        """Multiply-accumulates of one block per token, averaged over a causal sequence."""
        D, r = self.d_model, self.mlp_ratio
        dense = 4 * D * D + 2 * r * D * D  # qkv + out projection + MLP
        # Scores and weighted values: token t attends to t + 1 positions (mean (T+1)/2).
        attention = 2 * D * (seq_len + 1) / 2
        return int(dense + attention)

    def readout_macs(self) -> int:
        """Multiply-accumulates of the read-out per token."""
        return self.d_model * self.vocab_size


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every predicted position: (B, T, V), (B, T) -> ()."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
