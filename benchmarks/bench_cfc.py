"""Our CfC sequence forward + backward against ncps's CfC of the same size, in one process;
then one full CfC-aux trainer step against a plain-PyTorch step of the same model.

Sequence: batch 32 x 50 steps x 20 inputs -> 64 units, backbone 128 units (ncps's default),
default mode, CPU, one thread. Timed: outputs of every step, a sum, backward into every
parameter and the input. The implementations of ``lab.models.cfc.CfC`` (DESIGN section 7)
run side by side:

- ``loop``: hoisted input product + fused heads, per-step torch autograd;
- ``function``: one autograd Function, hand-written backward through time in torch ops;
- ``numba``: the same Function with each direction's time loop compiled (element-wise work
  fused and vectorised, per-step products on BLAS, weight gradients one product each).

Trainer step (``lab.train.cfc_aux.train_step``: a batch, encoder, main + aux trunks, the
joined gradient after the lift, both Adam steps, the health update) at the trainer's defaults
with ``--seq-len`` steps, against the same model and batches in plain PyTorch: the same
encoder and heads, ncps's CfC as both trunks (our per-step ``loop`` without ncps), one
backward through the summed losses, the two Adam steps.

Calls are interleaved round-robin so machine noise hits every variant alike; the ratio of
medians reference / ours is printed (> 1: ours faster; the sequence target is >= 3).

    python benchmarks/bench_cfc.py [--rounds 30] [--threads 1] [--seq-len 50]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.device import configure_process
from lab.models.cfc import CfC, load_ncps
from lab.train.cfc_aux import CfCAuxConfig, build_run, train_step

BATCH, STEPS, INPUTS, UNITS = 32, 50, 20, 64
TARGET = 3.0

try:
    from ncps.torch import CfC as NcpsCfC
except ImportError:
    NcpsCfC = None


def _step(model, x):
    def run():
        model.zero_grad(set_to_none=True)
        x.grad = None
        out, _ = model(x)
        out.sum().backward()
    return run


def _race(variants: dict, rounds: int) -> dict:
    """Median seconds of each variant, calls interleaved round-robin after two warm-ups."""
    times = {name: [] for name in variants}
    for run in variants.values():  # warm-up: numba compiles (or loads its cache) here
        run(), run()
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _report(medians: dict, base: str) -> None:
    for name, med in medians.items():
        print(f"  {name:22s} {med * 1e3:7.2f} ms  {base}/this = {medians[base] / med:.2f}x")


def sequence(rounds: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(BATCH, STEPS, INPUTS, requires_grad=True)
    variants = {}
    ours = {impl: CfC(INPUTS, UNITS, impl=impl) for impl in ("loop", "function", "numba")}
    if NcpsCfC is None:
        print("ncps is not installed: timing ours only (pip install ncps==1.0.1 to compare)")
    else:
        theirs = NcpsCfC(INPUTS, UNITS)
        for model in ours.values():
            load_ncps(model, theirs)
        variants["ncps"] = _step(theirs, x)
    variants.update({f"ours/{impl}": _step(model, x) for impl, model in ours.items()})
    medians = _race(variants, rounds)
    print(f"CfC forward+backward: batch {BATCH}, {STEPS} steps, {INPUTS} inputs -> {UNITS} "
          f"units, CPU, {torch.get_num_threads()} thread(s), median of {rounds} rounds")
    base = "ncps" if "ncps" in medians else "ours/loop"
    _report(medians, base)
    if base == "ncps":
        best = medians["ncps"] / medians["ours/numba"]
        print(f"target: ours (numba, the CPU default) >= {TARGET}x ncps: {best:.2f}x, "
              f"{'met' if best >= TARGET else 'NOT met'}")


@torch.no_grad()
def _to_ncps(ours: CfC):
    """An ncps CfC holding our trunk's weights (the inverse of ``load_ncps``)."""
    cell = ours.cell
    theirs = NcpsCfC(ours.input_size, ours.hidden_size, mode=cell.mode,
                     backbone_units=cell.backbone[0].out_features,
                     backbone_layers=len(cell.backbone), activation=cell.activation)
    layers = [m for m in theirs.rnn_cell.backbone if isinstance(m, nn.Linear)]
    for src, dst in zip(cell.backbone, layers):
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)
    names = ["ff1"] if cell.mode == "pure" else ["ff1", "ff2", "time_a", "time_b"]
    for name, w, b in zip(names, cell.heads.weight.split(ours.hidden_size),
                          cell.heads.bias.split(ours.hidden_size)):
        getattr(theirs.rnn_cell, name).weight.copy_(w)
        getattr(theirs.rnn_cell, name).bias.copy_(b)
    return theirs


class _Path(nn.Module):
    """A trunk (anything returning (outputs, h_n)) and a linear head on h_n."""

    def __init__(self, trunk, head):
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, e):
        return self.head(self.trunk(e)[1])


def _reference_step(run, generator):
    """The trainer's step in plain PyTorch: one backward through the summed losses (the
    encoder gets both paths' gradients, as after the lift), then both Adam steps."""
    cfg = run.config
    encoder = copy.deepcopy(run.encoder)
    if NcpsCfC is not None and cfg.main_buckets == 1 and cfg.main_tau_max == 1.0:
        trunks = [_to_ncps(run.main.trunk), _to_ncps(run.aux.trunk)]
    else:
        trunks = [copy.deepcopy(run.main.trunk), copy.deepcopy(run.aux.trunk)]
        for trunk in trunks:
            trunk.impl = "loop"
    main = _Path(trunks[0], copy.deepcopy(run.main.head))
    aux = _Path(trunks[1], copy.deepcopy(run.aux.heads))
    with torch.no_grad():  # the same model: equal outputs before any step
        x = run.data.sample(cfg.batch_size, torch.Generator().manual_seed(0)).x
        torch.testing.assert_close(main(encoder(x))[:, 0], run.main(run.encoder(x)),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(aux(encoder(x)), torch.cat(run.aux(run.encoder(x)), -1),
                                   rtol=0, atol=1e-5)
    opt_main = torch.optim.Adam([*encoder.parameters(), *main.parameters()], lr=cfg.lr)
    opt_aux = torch.optim.Adam(aux.parameters(), lr=cfg.aux_lr)

    def step():
        batch = run.data.sample(cfg.batch_size, generator)
        opt_main.zero_grad(set_to_none=True)
        opt_aux.zero_grad(set_to_none=True)
        enc = encoder(batch.x)
        logits = main(enc)[:, 0]
        long, short = aux(enc).chunk(2, dim=-1)
        per_h = 0.5 * (F.huber_loss(long, batch.long, reduction="none", delta=cfg.huber_delta)
                       + F.huber_loss(short, batch.short, reduction="none",
                                      delta=cfg.huber_delta)).mean(0)
        loss = F.binary_cross_entropy_with_logits(logits, batch.direction)
        (loss + per_h.sum()).backward()
        opt_main.step()
        opt_aux.step()
        with torch.no_grad():
            acc = ((long > short) == (batch.long > batch.short)).float().mean(0)
        return loss.item(), per_h.tolist(), acc.tolist()
    return step, "ncps trunks" if NcpsCfC is not None else "torch loop trunks"


def trainer_step(rounds: int, threads: int, seq_len: int) -> None:
    config = CfCAuxConfig(source="synthetic", seq_len=seq_len, threads=threads, device="cpu",
                          progress=False)
    run = build_run(config)
    run.health.lifted = True  # the heavier step: the aux gradient joins the encoder's
    counter = iter(range(10 ** 9))
    reference, name = _reference_step(run, torch.Generator().manual_seed(1))
    medians = _race({f"reference ({name})": reference,
                     "ours (train_step)": lambda: train_step(run, next(counter))}, rounds)
    print(f"CfC-aux trainer step: batch {config.batch_size}, {seq_len} steps, enc {config.enc_dim}"
          f" -> main {config.units} + aux {config.aux_units} units, backbone "
          f"{config.backbone_units}, both optimizers, median of {rounds} rounds")
    _report(medians, f"reference ({name})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=STEPS,
                        help="steps per example in the trainer-step comparison")
    args = parser.parse_args()
    configure_process(args.threads)  # threads and the allocator policy, as runs
    sequence(args.rounds)
    trainer_step(args.rounds, args.threads, args.seq_len)


if __name__ == "__main__":
    main()
