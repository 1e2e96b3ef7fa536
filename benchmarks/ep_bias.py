"""EP's gradient bias against beta: ||g_EP - g_BP|| / ||g_BP|| and the cosine, per K.

The cosine of EP's gradient with backprop's is ~1 by construction (the forces are exact
vector-Jacobian products); what the nudging strength beta changes is an O(beta) bias, which
this measures. One batch of the bundled corpus, float64, the default ``EPConfig`` model (causal
transformer, d_model 64, 3 blocks, 4 heads, sequence 64, batch 32) at its initialisation:
``ep_gradient`` at each (beta, K) against ``bp_gradient`` on the same parameters, over all
parameters together. Prints a markdown table, the log-log slope of the error against beta, and
what K > 1 changes at the default beta; with ``--out`` writes the table (``.md``) and a log-log
figure (``.png``, one line per K)::

    python benchmarks/ep_bias.py --out benchmarks/results/ep-bias
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from lab.data.text import load_corpus, sample_batch  # noqa: E402
from lab.device import configure_process, seeded  # noqa: E402
from lab.models.transformer import Transformer  # noqa: E402
from lab.train.ep import EPConfig, bp_gradient, ep_gradient  # noqa: E402

BETAS = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
KS = (1, 2, 4)
SMALL_BETA = 0.03  # the slope is fitted on beta <= this (the linear regime)


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together."""
    diff = sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True))
    return math.sqrt(diff / sum(float(y.pow(2).sum()) for y in b))


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine of a and b as one vector each."""
    dot = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    na = sum(float(x.pow(2).sum()) for x in a)
    nb = sum(float(y.pow(2).sum()) for y in b)
    return dot / math.sqrt(na * nb)


def loglog_slope(betas, errors) -> float:
    """Least-squares slope of log(error) against log(beta)."""
    return float(np.polyfit(np.log(betas), np.log(errors), 1)[0])


def measure(model, x, y, betas=BETAS, Ks=KS) -> dict:
    """{(beta, K): (relative error, cosine, ||g_K - g_K0|| / ||g_BP||)} of EP against BP on
    one batch; K0 is the first of ``Ks``."""
    bp, _ = bp_gradient(model, x, y)
    bp_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in bp))
    out, first = {}, {}
    for K in Ks:
        for beta in betas:
            ep = ep_gradient(model, x, y, beta=beta, K=K).grads
            first.setdefault(beta, ep)
            apart = math.sqrt(sum(float((a - b).pow(2).sum())
                                  for a, b in zip(ep, first[beta], strict=True))) / bp_norm
            out[beta, K] = (relative_error(ep, bp), cosine(ep, bp), apart)
    return out


def default_model_and_batch(config: EPConfig, seed: int):
    """The config's model in float64 at its initialisation and one training batch."""
    corpus = load_corpus("", seq_len=config.seq_len)
    with seeded(seed):
        model = Transformer(corpus.vocab_size, config.seq_len, config.d_model, config.n_layers,
                            config.n_heads, config.mlp_ratio, dtype=torch.float64)
    x, y = sample_batch(corpus.train, config.batch_size, config.seq_len,
                        torch.Generator().manual_seed(seed))
    return model, x, y


def report(results: dict, betas, Ks, default_beta: float) -> str:
    """The markdown table, the fitted slopes and the K comparison at the default beta."""
    lines = ["| beta | " + " | ".join(f"rel. error K={K} | cosine K={K}" for K in Ks) + " |",
             "| --- |" + " --- | --- |" * len(Ks)]
    for beta in betas:
        cells = " | ".join(f"{results[beta, K][0]:.3e} | {results[beta, K][1]:.9f}" for K in Ks)
        lines.append(f"| {beta:g} | {cells} |")
    lines.append("")
    small = [b for b in betas if b <= SMALL_BETA]
    for K in Ks:
        fit = loglog_slope(small, [results[b, K][0] for b in small])
        whole = loglog_slope(betas, [results[b, K][0] for b in betas])
        lines.append(f"- K={K}: log-log slope {fit:.3f} on beta <= {SMALL_BETA:g}, "
                     f"{whole:.3f} on all beta")
    if default_beta in betas:
        base = results[default_beta, Ks[0]][0]
        ratios = ", ".join(f"K={K}: {results[default_beta, K][0] / base:.6f}"
                           for K in Ks[1:])
        lines.append(f"- at the default beta {default_beta:g}, relative error over "
                     f"K={Ks[0]}'s: {ratios}")
        for beta in (default_beta, betas[-1]):
            apart = ", ".join(f"K={K}: {results[beta, K][2]:.2e}" for K in Ks[1:])
            lines.append(f"- ||g_K - g_K={Ks[0]}|| / ||g_BP|| at beta {beta:g}: {apart}")
    return "\n".join(lines)


def figure(results: dict, betas, Ks, path: Path) -> None:
    """Left: the bias against beta, one line per K. Right: how far K > 1 moves the gradient
    from K = Ks[0]'s, on the same scale (relative to ||g_BP||)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = [("o", "-", 8), ("s", "--", 6), ("^", ":", 5)]
    for i, ((marker, line, size), K) in enumerate(zip(styles, Ks)):
        left.loglog(betas, [results[b, K][0] for b in betas], marker=marker, ls=line,
                    ms=size, color=f"C{i}", label=f"K = {K}")
    ref = results[betas[0], Ks[0]][0]
    left.loglog(betas, [0.5 * ref * b / betas[0] for b in betas], "k-", lw=0.6,
                label="slope 1 (x 0.5)")
    left.set(xlabel="beta", ylabel="||g_EP - g_BP|| / ||g_BP||",
             title="EP bias (float64, one batch, at init.)")
    left.legend()
    right.loglog(betas, [results[b, Ks[0]][0] for b in betas], "k-", lw=0.6,
                 label=f"bias, K = {Ks[0]}")
    for i, ((marker, line, size), K) in enumerate(zip(styles, Ks)):
        if i:
            right.loglog(betas, [results[b, K][2] for b in betas], marker=marker, ls=line,
                         ms=size, color=f"C{i}", label=f"K = {K}")
    right.set(xlabel="beta", ylabel=f"||g_K - g_(K={Ks[0]})|| / ||g_BP||",
              title=f"what K > {Ks[0]} changes")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the model's init and the batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help="write OUT.md and OUT.png (e.g. benchmarks/results/ep-bias)")
    args = parser.parse_args()
    configure_process(args.threads)
    config = EPConfig()
    model, x, y = default_model_and_batch(config, args.seed)
    start = time.perf_counter()
    results = measure(model, x, y)
    wall = time.perf_counter() - start
    text = report(results, BETAS, KS, config.beta)
    header = (f"EP gradient against backprop: EPConfig's default model (d_model "
              f"{config.d_model}, {config.n_layers} blocks, {config.n_heads} heads, sequence "
              f"{config.seq_len}, batch {config.batch_size}) in float64 at its initialisation "
              f"(seed {args.seed}), one batch of the bundled corpus; relative error "
              "||g_EP - g_BP|| / ||g_BP|| and cosine over all parameters together. K rounds "
              "cost K + 1 forward chains (`benchmarks/bench_ep.py` times them).\n"
              f"Command: `python benchmarks/ep_bias.py --out benchmarks/results/ep-bias` "
              f"({wall:.0f} s, {args.threads} thread).\n")
    print(header)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(f"# EP gradient bias\n\n{header}\n{text}\n")
        figure(results, BETAS, KS, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
