"""benchmarks/gguf_compare.py reads one call's raw lines as llama_cpp.sh and gguf_bench.py print them."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gguf_compare import compare, llama_runs, read_lines, strata_runs


def _llama_bench(file: str, prompt: int, gen: int, rate: float, cpu_moe: int = 0) -> str:
    line = {"model_filename": file, "n_prompt": prompt, "n_gen": gen, "avg_ts": rate, "n_cpu_moe": cpu_moe}
    return json.dumps(line)


def _batched(sequences: int, rate: float) -> str:
    return json.dumps({"pl": sequences, "speed_tg": rate, "pp": 128, "tg": 128})


def test_two_runs_of_each_engine_give_medians_and_their_ratio(tmp_path: Path) -> None:
    """A run of llama.cpp is a llama-bench of the file and the batched-bench lines after it; the build's
    and the driver's text, and a run with experts on the CPU, are skipped; a tiered Strata run too."""
    llama = tmp_path / "llama.jsonl"
    run = [
        "ggml_cuda_init: found 1 CUDA devices",
        _llama_bench("/tmp/q.gguf", 8192, 0, 20000.0),
        _llama_bench("/tmp/q.gguf", 0, 128, 500.0),
        _batched(1, 480.0),
        _batched(8, 1400.0),
        _batched(32, 2300.0),
    ]
    cpu_moe = [_llama_bench("/tmp/q.gguf", 0, 128, 100.0, cpu_moe=18), _batched(8, 150.0)]
    second = [_llama_bench("/tmp/q.gguf", 8192, 0, 21000.0), _llama_bench("/tmp/q.gguf", 0, 128, 520.0)]
    second += [_batched(8, 1500.0), _batched(32, 2400.0)]
    llama.write_text("\n".join(run + cpu_moe + second) + "\n")
    strata = tmp_path / "strata.jsonl"

    def strata_line(bs8: float, cache: int | None = None) -> str:
        decode = {f"decode_bs{b}": {"tok_s": rate} for b, rate in ((1, 650.0), (8, bs8), (32, 4200.0))}
        prompt = {"prefill_8k": {"tok_s": 49000.0}}
        return json.dumps({"model": "q.gguf", "expert_cache": cache, **decode, **prompt})

    strata.write_text("\n".join([strata_line(2100.0), strata_line(2200.0), strata_line(200.0, cache=32)]))
    ours, theirs = strata_runs(read_lines([strata])), llama_runs(read_lines([llama]))
    assert len(ours["q.gguf"]) == 2 and len(theirs["q.gguf"]) == 2
    (row,) = compare(ours, theirs)
    bs8 = {"strata": [2100.0, 2200.0], "llama_cpp": [1400.0, 1500.0], "ratio_of_medians": 1.483}
    assert row["bs8"] == bs8
    assert row["bs1"]["llama_cpp"] == [500.0, 520.0] and row["prompt_8k"]["llama_cpp"] == [20000.0, 21000.0]
    assert row["bs32"]["ratio_of_medians"] == round(4200 / 2350, 3)


def test_each_file_of_a_llama_cpp_run_is_a_run_of_its_own(tmp_path: Path) -> None:
    """llama_cpp.sh times several files one after another: each file's lines are that file's run, even where
    the next file's first line is a figure the run before lacks."""
    llama = tmp_path / "llama.jsonl"
    lines = [_llama_bench("/tmp/a.gguf", 8192, 0, 20000.0), _batched(8, 1400.0)]
    lines += [_llama_bench("/tmp/b.gguf", 0, 128, 600.0), _batched(8, 1700.0)]
    llama.write_text("\n".join(lines) + "\n")
    runs = llama_runs(read_lines([llama]))
    assert runs["a.gguf"] == [{"prompt_8k": 20000.0, "bs8": 1400.0}]
    assert runs["b.gguf"] == [{"bs1": 600.0, "bs8": 1700.0}]
