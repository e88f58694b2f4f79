"""Picks, from `benchmarks/tune_held.py --warps ...` lines, which held kinds' experts the CUDA kernels should
take and with how many warps a block: for each kind the choice ("default": the Triton kernels, or "cuda wN")
with the least time summed over the windows timed. Prints shell exports of STRATA_CUDA_HELD_EXPERTS and
STRATA_CUDA_HELD_WARPS (app/kernels/cuda_held.py reads them), and each kind's sums on stderr.

    eval "$(python benchmarks/pick_held.py tune.log)"
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^(\S+) experts tokens (\d+) (default|cuda w\d+)\s+([\d.]+) us")


def pick(lines: list[str]) -> tuple[list[str], dict[str, int], dict[str, dict[str, float]]]:
    """The kinds whose best choice is a CUDA one, their warps, and every kind's summed microseconds."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for line in lines:
        match = LINE.match(line)
        if match:
            kind, _, choice, us = match.groups()
            sums[kind][choice] += float(us)
    kinds, warps = [], {}
    for kind, choices in sums.items():
        best = min(choices, key=choices.__getitem__)
        if best.startswith("cuda"):
            kinds.append(kind)
            warps[kind] = int(best.removeprefix("cuda w"))
    return kinds, warps, sums


def main() -> None:
    kinds, warps, sums = pick(Path(sys.argv[1]).read_text().splitlines())
    for kind, choices in sums.items():
        print(kind, {choice: round(us, 1) for choice, us in choices.items()}, file=sys.stderr)
    print(f'export STRATA_CUDA_HELD_EXPERTS="{" ".join(kinds)}"')
    print(f'export STRATA_CUDA_HELD_WARPS="{" ".join(f"{k}={n}" for k, n in warps.items())}"')


if __name__ == "__main__":
    main()
