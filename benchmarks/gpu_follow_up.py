"""A follow-up turn's time to first token on one GPU: from the prefix cache, from a park file, read again.

    python benchmarks/gpu_follow_up.py --shape q30-half [--shape qnext] [--tokens 8192 --tokens 32768]

For each shape (random bf16 weights built on the card, as in gpu_bench.py) and conversation length N: a first
turn reads N tokens and answers 16; the follow-up (the conversation plus 32 new tokens) is timed to its first
token on the same engine (the conversation is in the device's prefix cache), on a fresh engine over the same
park directory (the state comes back from the file written when the first turn ended: what a restart sees),
and on an engine with the prefix cache off (the whole conversation read again). Engines share the model but
not their KV pools. Ends with one JSON line per shape and length.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.protocol import AddRequest, SamplingParams
from app.kernels.backends import select_backends
from app.loading.checkpoint import CheckpointDir
from app.loading.model import LoadedModel
from app.text.tokenizer import Tokenizer
from benchmarks.gpu_bench import bench_config, build_model, write_model_dir
from benchmarks.results import emit

ANSWER = 16
FOLLOW_UP = 32


def _first_token(core: EngineCore, name: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first token, and every token it generated."""
    began = time.perf_counter()
    rejected = core.add_request(
        AddRequest(name, prompt, SamplingParams(max_tokens=ANSWER, temperature=0, ignore_eos=True))
    )
    if rejected:
        raise RuntimeError(rejected[0].error)
    first, tokens = None, []
    while core.has_work():
        outputs, _ = core.step()
        for output in outputs:
            tokens += output.token_ids
        if first is None and tokens:
            torch.cuda.synchronize()
            first = time.perf_counter() - began
    assert first is not None
    return first, tokens


def _free() -> None:
    """Give an engine's KV pool back to the card before the next one is made."""
    gc.collect()
    torch.cuda.empty_cache()


def run(name: str, lengths: list[int], out: str | None) -> list[dict[str, Any]]:
    """Every conversation length on one shape's random model; one dict per length (also appended to `out`)."""
    config = bench_config(name)
    backends = select_backends("auto", "cuda")
    model = build_model(config, backends, "cuda")
    path = Path(tempfile.mkdtemp(prefix="strata-follow-up-")) / "random"
    write_model_dir(path, config)
    loaded = LoadedModel(model, Tokenizer.from_dir(path), CheckpointDir(path), (), torch.device("cuda"))
    lines = []
    for length in lengths:
        parked = path.parent / f"parked-{length}"
        engine = EngineConfig(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            parallel=8,
            max_batched_tokens=8192,
            kv_memory=4 << 30,
            max_model_len=length + ANSWER + FOLLOW_UP + 64,
            park_memory=8 << 30,
            park_dir=str(parked),
            park_disk=64 << 30,
        )
        prompt = torch.randint(3, config["vocab_size"], (length,), generator=torch.Generator().manual_seed(1))
        first = prompt.tolist()
        core = EngineCore(engine, loaded)
        # Compile the kernels' shapes first: a prompt, and a follow-up continuing it from the cache.
        _, warm = _first_token(core, "warm", first[:1024])
        _first_token(core, "warm-follow-up", first[:1024] + warm + list(range(3, 3 + FOLLOW_UP)))
        ttft_first, answer = _first_token(core, "first", first)
        follow_up = first + answer + list(range(3, 3 + FOLLOW_UP))
        ttft_cached, cached = _first_token(core, "cached", follow_up)
        core.close()
        del core
        _free()
        core = EngineCore(engine, loaded)
        ttft_restored, restored = _first_token(core, "restored", follow_up)
        assert core.park is not None
        restore_s = core.park.stats().restore_seconds
        del core
        _free()
        core = EngineCore(msgspec.structs.replace(engine, prefix_cache=False), loaded)
        ttft_reread, reread = _first_token(core, "reread", follow_up)
        del core
        _free()
        lines.append(
            {
                "shape": name,
                "layers": config["num_hidden_layers"],
                "device": torch.cuda.get_device_name(),
                "date": time.strftime("%Y-%m-%d"),
                "conversation_tokens": length + ANSWER,
                "ttft_first_turn_s": ttft_first,
                "ttft_follow_up_cached_s": ttft_cached,
                "ttft_follow_up_restored_from_disk_s": ttft_restored,
                "restore_s": restore_s,
                "ttft_follow_up_read_again_s": ttft_reread,
                "same_tokens": cached == restored == reread,
            }
        )
        emit(lines[-1], out)
    shutil.rmtree(path.parent, ignore_errors=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", action="append", required=True, help="q30, q30-half or qnext (repeatable)")
    parser.add_argument("--tokens", action="append", type=int, help="conversation lengths (8192 and 32768)")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_follow_up needs a CUDA device")
    for name in args.shape:
        run(name, args.tokens or [8192, 32768], args.out)
        _free()


if __name__ == "__main__":
    main()
