"""Host time of laying out one decode window over long conversations (no model runs).

    python benchmarks/layout_host.py [--model DIR] [--seqs 8] [--tokens 131072] [--out results.jsonl]

A paged state of the model's shapes (its config.json; by default the tiny test model, written here) holding
`--seqs` conversations of `--tokens` tokens each, one decode row each. Times what the host does for such a
window before the device runs it: `PagedState.layout` (block tables, slot mapping, one copy) and
`count_reads` (where the blocks read live), with the pool wholly on the device and with half of its blocks in
host RAM (`--kv-resident`). The best of 10 calls, in milliseconds; one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.paged_state import PagedState
from app.models.batch import SequenceSpan
from app.models.config import ModelConfig
from benchmarks.results import emit


def best_ms(call, repeats: int = 10) -> float:
    call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="an HF directory (its config.json is read)")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--out", help="also append the JSON line to this file")
    args = parser.parse_args()
    model = args.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from checkpoints import write_checkpoint

        model = write_checkpoint(Path(tempfile.mkdtemp()), "qwen3_moe")
    config = ModelConfig.from_dict(json.loads((model / "config.json").read_text()))
    size = 16
    each = -(-args.tokens // size)
    blocks = args.seqs * each
    line: dict = {"seqs": args.seqs, "tokens": args.tokens, "blocks": blocks}
    for name, resident in (("device", None), ("half_in_host_ram", blocks // 2)):
        cpu = torch.device("cpu")
        state = PagedState(config, blocks, size, args.seqs, torch.float32, cpu, resident=resident)
        for seq in range(args.seqs):
            state.set_block_table(seq, list(range(seq * each, (seq + 1) * each)))
        spans = [SequenceSpan(seq=s, start=s, length=1, past=args.tokens - 1) for s in range(args.seqs)]
        tables = [(state.block_tables[s], args.tokens) for s in range(args.seqs)]
        line[f"{name}_layout_ms"] = best_ms(lambda state=state, spans=spans: state.layout(spans))
        line[f"{name}_count_reads_ms"] = best_ms(lambda state=state, tables=tables: state.count_reads(tables))
    emit(line, args.out)


if __name__ == "__main__":
    main()
