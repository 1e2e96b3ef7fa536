"""EP step time relative to a backprop step, for K = 1, 2, 4, measured in one process.

The default ``EPConfig`` model (causal transformer, d_model 64, 3 blocks, 4 heads, sequence 64,
batch 32, the bundled corpus's vocabulary), CPU, a full training step: the gradient
(:func:`lab.train.ep.ep_gradient` or backprop), ``.grad`` written, AdamW step. Steps are
interleaved round-robin so machine noise hits every variant alike; the ratio of medians is
printed beside the design's target (EP / BP <= K + 1: a free chain plus K rebuilds is K + 1
forward chains, against backprop's forward + backward of about 3 forward chains).

    python benchmarks/bench_ep.py [--rounds 20] [--threads 1] [--K 1,2,4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.data.text import load_corpus, sample_batch
from lab.device import configure_process, seeded
from lab.models.transformer import Transformer
from lab.train.ep import EPConfig, bp_gradient, ep_gradient


def _stepper(config: EPConfig, vocab_size: int, x, y, K: int | None):
    """A closure doing one full step: EP with K rounds, or backprop when K is None."""
    with seeded(0):
        model = Transformer(vocab_size, config.seq_len, config.d_model, config.n_layers,
                            config.n_heads, config.mlp_ratio)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        grads = bp_gradient(model, x, y)[0] if K is None else \
            ep_gradient(model, x, y, config.beta, K).grads
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        for p in params:
            p.grad = None
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--K", default="1,2,4")
    args = parser.parse_args()
    configure_process(args.threads)  # threads and the allocator policy, as runs
    config = EPConfig()
    corpus = load_corpus("", seq_len=config.seq_len)
    x, y = sample_batch(corpus.train, config.batch_size, config.seq_len,
                        torch.Generator().manual_seed(0))
    Ks = [int(k) for k in args.K.split(",")]
    steps = {"bp": _stepper(config, corpus.vocab_size, x, y, None)}
    steps.update({f"ep K={K}": _stepper(config, corpus.vocab_size, x, y, K) for K in Ks})
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up: allocator, kernels
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    bp = statistics.median(times["bp"])
    print(f"model: d_model {config.d_model}, {config.n_layers} blocks, seq {config.seq_len}, "
          f"batch {config.batch_size}, vocab {corpus.vocab_size}; {args.threads} thread(s), "
          f"{args.rounds} rounds, torch {torch.__version__}")
    print(f"{'step':<10} {'median ms':>10} {'/ bp':>7} {'target':>7}")
    print(f"{'bp':<10} {1000 * bp:>10.1f} {1.0:>7.2f}")
    for K in Ks:
        t = statistics.median(times[f"ep K={K}"])
        verdict = "ok" if t / bp <= K + 1 else "OVER"
        print(f"{f'ep K={K}':<10} {1000 * t:>10.1f} {t / bp:>7.2f} {f'<= {K + 1}':>7}  {verdict}")


if __name__ == "__main__":
    main()
