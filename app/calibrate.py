"""`strata autoconfig --calibrate`: autoconfig's choice and its neighbours timed with every slot busy.

The rules (app/autoconfig.py) size everything from memory arithmetic; what they cannot know is how fast this
machine runs each choice. `candidates` lists the choice and the settings next to it that fit the same memory
(half the slots; for an expert tier, the budget in whole layers; for a layer split, one slot group), and
`calibrate` starts an engine with each, keeps every slot busy with a request (a CALIBRATE_PROMPT-token prompt,
CALIBRATE_OUTPUT tokens out), and keeps the one with the highest aggregate decode rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from app.autoconfig import Settings

CALIBRATE_PROMPT = 128  # tokens of each slot's prompt
CALIBRATE_OUTPUT = 64  # tokens each slot generates

Measure = Callable[[Settings], float]  # a candidate's aggregate tok/s with every slot busy


def candidates(chosen: Settings) -> list[Settings]:
    """The choice first, then its neighbours that need no more memory than it."""
    found = [chosen]
    if chosen.parallel >= 2:
        found.append(dataclasses.replace(chosen, parallel=chosen.parallel // 2, reasons=[]))
    if chosen.expert_cache:
        found.append(dataclasses.replace(chosen, expert_placement="layers", adapt_async=False, reasons=[]))
    if chosen.batch_groups is not None and chosen.batch_groups > 1:
        found.append(dataclasses.replace(chosen, batch_groups=1, reasons=[]))
    return found


def calibrate(chosen: Settings, measure: Measure, report: Callable[[str], None] = print) -> Settings:
    """Time every candidate with `measure`, `report` a line each, and return the fastest, its reasons the
    choice's with the timing added."""
    timed = []
    for candidate in candidates(chosen):
        rate = measure(candidate)
        report(f"  {rate:9.1f} tok/s with {candidate.parallel} slots busy: {' '.join(candidate.flags())}")
        timed.append((rate, candidate))
    rate, best = max(timed, key=lambda pair: pair[0])  # the first of equals: the rules' own choice
    others = ", ".join(f"{r:.1f}" for r, c in timed if c is not best)
    reasons = [
        *chosen.reasons,
        f"calibrated: {rate:.1f} tok/s with every slot busy, the fastest of "
        f"{len(timed)} candidates (the others: {others} tok/s)",
    ]
    return dataclasses.replace(best, reasons=reasons)


def bench_measure(model: str) -> Measure:
    """A Measure that starts `strata serve`'s engine on `model` with a candidate's flags and runs
    `strata bench`'s scenario with one request a slot."""
    from app.bench import run_bench
    from app.cli import build_parser, engine_config

    def measure(candidate: Settings) -> float:
        args = build_parser().parse_args(["serve", "--model", model, *candidate.flags()])
        config = engine_config(args)
        summary = run_bench(config, candidate.parallel, CALIBRATE_PROMPT, CALIBRATE_OUTPUT)
        return float(summary["aggregate_tok_s"])

    return measure
