"""The CfC-aux comparison's lift, per run (notebook 30-cfc-summary).

The trainer (``lab.train.cfc_aux``; CfC: Hasani et al. 2022, "Closed-form
continuous-time neural networks") records ``final.lift_step``: the step at which
the aux gradient was lifted into the encoder, or None when the lift never fired
(the ``never`` and ``none`` arms, or a ``lift`` run whose aux trunk did not become
healthy in time). None is an outcome here, not a missing value, so it is shown as
None, never dropped.
"""

from __future__ import annotations

import math

import pandas as pd

LIFT = "final.lift_step"
_SHOWN = ("aux", "seed", LIFT, "final.val_acc", "final.val_up_fraction")


def _step(value) -> int | None:
    # The runs table holds the step as a float (NaN for None): back to what was recorded.
    return None if value is None or (isinstance(value, float) and math.isnan(value)) \
        else int(value)


def _check(table: pd.DataFrame, caller: str) -> None:
    for column in ("run_id", LIFT):
        if column not in table.columns:
            raise KeyError(f"{caller}: column {column!r} not in the table (columns: "
                           f"{', '.join(map(str, table.columns))}); the CfC-aux trainer "
                           "records final.lift_step in every run (None when the lift did "
                           "not fire): are these CfC-aux runs?")


def lift_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per run, sorted by (aux, seed): aux, seed, ``final.lift_step`` (the step, or None when
    the lift did not fire), validation accuracy and the validation set's share of
    "up" labels (the accuracy of always answering "up"); columns the table lacks are
    left out, except ``final.lift_step``, which must be there."""
    _check(table, "lift_table")
    shown = table[[c for c in _SHOWN if c in table.columns]].copy()
    shown[LIFT] = pd.Series([_step(v) for v in table[LIFT]], index=table.index, dtype=object)
    order = [c for c in ("aux", "seed") if c in shown.columns]
    shown = shown.sort_values(order) if order else shown
    return shown.reset_index(drop=True)


def lift_steps(table: pd.DataFrame) -> dict:
    """{run_id: the step the lift fired at, or None} for every run of the table."""
    _check(table, "lift_steps")
    return {run_id: _step(step) for run_id, step in zip(table["run_id"], table[LIFT])}
