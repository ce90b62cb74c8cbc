"""Calibrating the cost model at start: a few synthetic steps on a free slot, timed on this machine."""

from __future__ import annotations

import logging
import time

from kvpool.daemon.engine.cost_model import CostModel, calibrate
from kvpool.daemon.llama.model import Model

log = logging.getLogger("kvpool.engine")


def calibrate_on_slot(model: Model, slot: int, cost: CostModel) -> None:
    """Run the synthetic steps in ``slot`` (empty, and emptied again after each) and fit ``cost`` to them."""
    batch = model.batch
    vocab = model.n_vocab

    def run(start: int, n: int, outputs: int = 1) -> float:
        for at in range(0, start, batch.capacity):  # the context, in batches the context accepts
            batch.clear()
            count = min(batch.capacity, start - at)
            batch.add(slot, [t % vocab for t in range(3 + at, 3 + at + count)], at, False)
            model.decode()
        n = min(n, batch.capacity)
        batch.clear()
        batch.add(slot, [t % vocab for t in range(7, 7 + n)], start, outputs)
        began = time.perf_counter()
        model.decode()
        seconds = time.perf_counter() - began
        model.forget_sequence(slot)
        return seconds

    try:
        calibrate(cost, run, guess_rows=model.draft_rows)
    except Exception:  # the online updates will still fit the model; serving matters more
        log.exception("cost model calibration failed; starting from the prior")
        model.forget_sequence(slot)
        return
    fitted = cost.status()
    log.info("cost model calibrated: small steps %s, large steps %s", fitted.small_steps, fitted.large_steps)
