"""Picks, from `benchmarks/tune_held.py` lines, which held kinds the CUDA kernels should take and how: for
each kind's experts the choice ("default": the Triton kernels, or "cuda wN [DEFINES]") with the least time
summed over the windows timed, and for its dense projections (attention's, not an LM head, which stays with
the Triton kernels) "cuda" or "default" the same way. Prints shell exports of STRATA_CUDA_HELD_EXPERTS,
STRATA_CUDA_HELD_WARPS, STRATA_CUDA_HELD_DEFINES and STRATA_CUDA_HELD_LINEAR (app/kernels/cuda_held.py
reads them), and each kind's sums on stderr.

    eval "$(python benchmarks/pick_held.py tune.log [dense.log])"

The defines build every kind's kernels, so a define goes in only where every kind the CUDA kernels take
picked it.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

EXPERTS = re.compile(r"^(\S+) experts tokens (\d+) (default|cuda w\d+(?: [A-Z0-9_]+=\S+)*)\s+([\d.]+) us")
DENSE = re.compile(r"^(\S+) (qkv|o) tokens (\d+) (default|cuda)\s+([\d.]+) us")


def _sums(lines: list[str], pattern: re.Pattern, choice_at: int) -> dict[str, dict[str, float]]:
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        match = pattern.match(line)
        if match:
            groups = match.groups()
            sums[groups[0]][groups[choice_at]] += float(groups[-1])
    return sums


def pick(lines: list[str]) -> dict[str, object]:
    """The picks: `experts` (kinds whose best is a CUDA choice), `warps` (theirs), `defines` (those every
    picked variant has), `linear` (kinds whose dense projections are faster on the CUDA kernels), and every
    kind's summed microseconds (`sums`, `dense_sums`)."""
    sums = _sums(lines, EXPERTS, 2)
    dense = _sums(lines, DENSE, 3)
    experts, warps, chosen = [], {}, {}
    for kind, choices in sums.items():
        best = min(choices, key=choices.__getitem__)
        if best.startswith("cuda"):
            experts.append(kind)
            words = best.split()
            warps[kind] = int(words[1].removeprefix("w"))
            chosen[kind] = dict(word.split("=") for word in words[2:])
    variants = list(chosen.values())
    defines = {
        name: value
        for name, value in (variants[0] if variants else {}).items()
        if all(variant.get(name) == value for variant in variants)
    }
    linear = [
        kind for kind, choices in dense.items() if choices.get("cuda", float("inf")) < choices["default"]
    ]
    return {
        "experts": experts,
        "warps": warps,
        "defines": defines,
        "linear": linear,
        "sums": sums,
        "dense_sums": dense,
    }


def main() -> None:
    lines = [line for path in sys.argv[1:] for line in Path(path).read_text().splitlines()]
    picked = pick(lines)
    for label in ("sums", "dense_sums"):
        for kind, choices in picked[label].items():
            print(label, kind, {choice: round(us, 1) for choice, us in choices.items()}, file=sys.stderr)
    print(f'export STRATA_CUDA_HELD_EXPERTS="{" ".join(picked["experts"])}"')
    print(f'export STRATA_CUDA_HELD_WARPS="{" ".join(f"{k}={n}" for k, n in picked["warps"].items())}"')
    print(f'export STRATA_CUDA_HELD_DEFINES="{" ".join(f"{k}={v}" for k, v in picked["defines"].items())}"')
    if any(DENSE.match(line) for line in lines):
        print(f'export STRATA_CUDA_HELD_LINEAR="{" ".join(picked["linear"])}"')


if __name__ == "__main__":
    main()
