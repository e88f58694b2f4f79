"""Picks, from `benchmarks/tune_held.py` lines, which held kinds the CUDA kernels should take and how: for
each kind's experts the choice ("default": the Triton kernels, or "cuda wN [DEFINES]") with the least time
summed over the windows timed, for its dense projections (attention's) "cuda" (or "cuda sW": k split over
blocks) or "default" the same way, and for its LM head (`lm_head` lines) the same again. Prints shell exports
of STRATA_CUDA_HELD_EXPERTS, STRATA_CUDA_HELD_WARPS, STRATA_CUDA_HELD_DOWN_WARPS, STRATA_CUDA_HELD_DEFINES,
STRATA_CUDA_HELD_PER_PAIR (where "cuda ... pN" won), STRATA_CUDA_HELD_PER_EXPERT (each kind's "eN", else 0),
STRATA_CUDA_HELD_LINEAR, STRATA_CUDA_HELD_SPLIT_WAVES and STRATA_CUDA_HELD_WIDE (app/kernels/cuda_held.py
reads them), and each kind's sums on stderr.

    eval "$(python benchmarks/pick_held.py tune.log [dense.log])"

The defines build every kind's kernels, so a define goes in only where every kind the CUDA kernels take
and the define changes (DEFINE_KINDS; else every kind) picked it. The split waves and the dense projections'
defines (`tune_held.py --dense-only --variants`, e.g. DENSE_STAGES) are one setting for every kind: the choice
with the least time summed over the kinds whose projections go to the CUDA kernels.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

EXPERTS = re.compile(
    r"^(\S+) experts tokens (\d+) "
    r"(default|cuda w\d+(?: d\d+)?(?: p\d+)?(?: e\d+)?(?: [A-Z0-9_]+=\S+)*)\s+([\d.]+) us"
)
DENSE = re.compile(
    r"^(\S+) (qkv|o) tokens (\d+) (default|cuda(?: s[\d.]+)?(?: [A-Z0-9_]+=\S+)*)\s+([\d.]+) us"
)
DEFINE_KINDS = {"Q8_HALF": ("Q8_0",), "DOWN_HALF": ("Q8_0",)}  # defines that change some kinds' kernels alone
WIDE = re.compile(r"^(\S+) (lm_head) tokens (\d+) (default|cuda)\s+([\d.]+) us")


DRIFT = re.compile(r"drift (\S+)")
# a choice whose result strays further from the default's on any line is wrong, never picked
DRIFT_LIMIT = 0.05


def _sums(lines: list[str], pattern: re.Pattern, choice_at: int) -> dict[str, dict[str, float]]:
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    matched = [(match.groups(), DRIFT.search(line)) for line in lines if (match := pattern.match(line))]
    wrong = {
        (groups[0], groups[choice_at])
        for groups, drift in matched
        if drift and not float(drift.group(1)) <= DRIFT_LIMIT
    }
    for groups, _ in matched:
        if (groups[0], groups[choice_at]) not in wrong:
            sums[groups[0]][groups[choice_at]] += float(groups[-1])
    return sums


def pick(lines: list[str]) -> dict[str, object]:
    """The picks: `experts` (kinds whose best is a CUDA choice), `warps` and `down_warps` (theirs, from "cuda
    wN [dM]": the down projection's as gate_up's unless named), `defines` (those every picked variant has),
    `linear` (kinds whose dense projections are faster on the CUDA kernels), `wide` (kinds whose LM head is),
    and every kind's summed microseconds (`sums`, `dense_sums`, `wide_sums`)."""
    sums = _sums(lines, EXPERTS, 2)
    dense = _sums(lines, DENSE, 3)
    wide = _sums(lines, WIDE, 3)
    experts, warps, down_warps, per_pair, per_expert, chosen = [], {}, {}, {}, {}, {}
    for kind, choices in sums.items():
        best = min(choices, key=choices.__getitem__)
        if best.startswith("cuda"):
            experts.append(kind)
            words = best.split()
            warps[kind] = int(words[1].removeprefix("w"))
            down = next((w for w in words[2:] if re.fullmatch(r"d\d+", w)), None)
            down_warps[kind] = int(down.removeprefix("d")) if down else warps[kind]
            per_pair[kind] = next((int(w[1:]) for w in words[2:] if re.fullmatch(r"p\d+", w)), 0)
            per_expert[kind] = next((int(w[1:]) for w in words[2:] if re.fullmatch(r"e\d+", w)), 0)
            chosen[kind] = dict(word.split("=") for word in words[2:] if "=" in word)
    defines = {}
    for name, value in {name: v for variant in chosen.values() for name, v in variant.items()}.items():
        deciding = [kind for kind in chosen if kind in DEFINE_KINDS.get(name, chosen)]
        if deciding and all(chosen[kind].get(name) == value for kind in deciding):
            defines[name] = value
    linear = _faster_on_cuda(dense)
    waves, dense_defines = _dense_choice({kind: dense[kind] for kind in linear})
    for name, value in dense_defines.items():
        defines.setdefault(name, value)
    return {
        "experts": experts,
        "warps": warps,
        "down_warps": down_warps,
        "defines": defines,
        "linear": linear,
        "split_waves": waves,
        # a block a pair up to this many tokens where every kind on the CUDA kernels picked it (0: as built)
        "per_pair": _agreed(per_pair),
        "per_expert": per_expert,  # each kind's: a block an expert up to this many tokens (0: the tiles)
        "wide": _faster_on_cuda(wide),
        "sums": sums,
        "dense_sums": dense,
        "wide_sums": wide,
    }


def _agreed(values: dict[str, int]) -> int:
    """The value every kind picked (0 where they differ or none did)."""
    return next(iter(set(values.values()))) if len(set(values.values())) == 1 else 0


def _dense_choice(sums: dict[str, dict[str, float]]) -> tuple[float, dict[str, str]]:
    """The dense projections' CUDA choice ("cuda [sW] [NAME=VALUE ...]": k split over about W blocks an SM,
    the source's defines) timed for every kind in `sums` with the least time summed over them: its split
    waves (0: none) and defines."""
    timed = [
        {choice: us for choice, us in choices.items() if choice.startswith("cuda")}
        for choices in sums.values()
    ]
    common = set.intersection(*(set(choices) for choices in timed)) if timed else set()
    if not common:
        return 0.0, {}
    best = min(sorted(common), key=lambda choice: sum(choices[choice] for choices in timed))
    words = best.split()[1:]
    waves = next((float(word[1:]) for word in words if re.fullmatch(r"s[\d.]+", word)), 0.0)
    return waves, dict(word.split("=") for word in words if "=" in word)


def _faster_on_cuda(sums: dict[str, dict[str, float]]) -> list[str]:
    """The kinds whose summed time is less on the CUDA kernels than on the default (Triton) tiles."""
    return [
        kind for kind, choices in sums.items() if min(choices, key=choices.__getitem__).startswith("cuda")
    ]


def main() -> None:
    lines = [line for path in sys.argv[1:] for line in Path(path).read_text().splitlines()]
    picked = pick(lines)
    for label in ("sums", "dense_sums", "wide_sums"):
        for kind, choices in picked[label].items():
            print(label, kind, {choice: round(us, 1) for choice, us in choices.items()}, file=sys.stderr)
    print(f'export STRATA_CUDA_HELD_EXPERTS="{" ".join(picked["experts"])}"')
    for name, key in (("WARPS", "warps"), ("DOWN_WARPS", "down_warps")):
        print(f'export STRATA_CUDA_HELD_{name}="{" ".join(f"{k}={n}" for k, n in picked[key].items())}"')
    print(f'export STRATA_CUDA_HELD_DEFINES="{" ".join(f"{k}={v}" for k, v in picked["defines"].items())}"')
    if picked["per_pair"]:
        print(f'export STRATA_CUDA_HELD_PER_PAIR="{picked["per_pair"]}"')
    per_expert = " ".join(f"{kind}={tokens}" for kind, tokens in picked["per_expert"].items())
    print(f'export STRATA_CUDA_HELD_PER_EXPERT="{per_expert}"')
    if any(DENSE.match(line) for line in lines):
        print(f'export STRATA_CUDA_HELD_LINEAR="{" ".join(picked["linear"])}"')
        print(f'export STRATA_CUDA_HELD_SPLIT_WAVES="{picked["split_waves"]:g}"')
    if any(WIDE.match(line) for line in lines):
        print(f'export STRATA_CUDA_HELD_WIDE="{" ".join(picked["wide"])}"')


if __name__ == "__main__":
    main()
