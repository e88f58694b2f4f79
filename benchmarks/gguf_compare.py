"""Issue 18's comparison from the raw lines of one call: Strata's figures on each GGUF file beside llama.cpp's
on the same file, every run of each engine and their medians, and the ratio of the medians.

    python benchmarks/gguf_compare.py --strata strata.jsonl [...] --llama llama.jsonl [...]

`--strata`: the JSON lines of `benchmarks/gguf_bench.py strata` (runs with an expert tier are left out);
`--llama`: what `benchmarks/llama_cpp.sh` printed (its build's and the driver's text lines are skipped):
llama-bench's lines name their file (tg128: decode at batch 1, pp8192: the 8K prompt), and the
llama-batched-bench lines after them (decode at 8 and 32 sequences) belong to the file last named; runs with
experts on the CPU (`--n-cpu-moe`) are left out. Prints one JSON line a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

FIGURES = ("bs1", "bs8", "bs32", "prompt_8k")
Runs = dict[str, list[dict[str, float]]]  # each file's runs: {file name: [{figure: tok/s}]}


def strata_runs(lines: list[dict[str, Any]]) -> Runs:
    """Each file's Strata runs (every expert on the card)."""
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for line in lines:
        if line.get("expert_cache") is not None or "decode_bs1" not in line:
            continue
        run = {f"bs{b}": line[f"decode_bs{b}"]["tok_s"] for b in (1, 8, 32) if f"decode_bs{b}" in line}
        if "prefill_8k" in line:
            run["prompt_8k"] = line["prefill_8k"]["tok_s"]
        runs[line["model"]].append(run)
    return runs


def llama_runs(lines: list[dict[str, Any]]) -> Runs:
    """Each file's llama.cpp runs with every layer on the GPU: a run is one llama-bench of the file and the
    llama-batched-bench lines after it."""
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    current: dict[str, float] | None = None
    current_name = None
    for line in lines:
        if "model_filename" in line:  # llama-bench: tg128 or pp8192
            name = Path(line["model_filename"]).name
            if line.get("n_cpu_moe", 0):
                current = None
                continue
            figure = "bs1" if line.get("n_gen", 0) and not line.get("n_prompt", 0) else "prompt_8k"
            if current is None or figure in current or name != current_name:
                current, current_name = {}, name
                runs[name].append(current)
            current[figure] = line["avg_ts"]
        elif "speed_tg" in line and current is not None and line.get("pl") in (8, 32):
            current[f"bs{line['pl']}"] = line["speed_tg"]
    return runs


def read_lines(paths: list[Path]) -> list[dict[str, Any]]:
    """The JSON objects among the files' lines, in order (other lines skipped)."""
    lines = []
    for path in paths:
        for text in path.read_text().splitlines():
            text = text.strip()
            if text.startswith("{"):
                try:
                    lines.append(json.loads(text))
                except json.JSONDecodeError:
                    continue
    return lines


def compare(strata: Runs, llama: Runs) -> list[dict]:
    """For each file both engines ran: each figure's runs, medians and Strata's median over llama.cpp's."""
    rows = []
    for name in sorted(set(strata) & set(llama)):
        row: dict[str, Any] = {"model": name}
        for figure in FIGURES:
            ours = [run[figure] for run in strata[name] if figure in run]
            theirs = [run[figure] for run in llama[name] if figure in run]
            if not ours or not theirs:
                continue
            mine, other = statistics.median(ours), statistics.median(theirs)
            row[figure] = {
                "strata": [round(v, 1) for v in ours],
                "llama_cpp": [round(v, 1) for v in theirs],
                "ratio_of_medians": round(mine / other, 3),
            }
        rows.append(row)
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--strata", type=Path, nargs="+", required=True)
    parser.add_argument("--llama", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    for row in compare(strata_runs(read_lines(args.strata)), llama_runs(read_lines(args.llama))):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
