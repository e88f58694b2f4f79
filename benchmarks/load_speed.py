"""How fast a checkpoint on disk loads onto the device: the loader's parallel reads against the page cache.

    python benchmarks/load_speed.py --shape q30-half --dir /tmp/q30-half [--resident 32] [--workers 1 8]

Writes the random checkpoint when the directory has none (benchmarks/random_checkpoint.py), reads every
shard once so that the page cache holds it, then times `load_model` (bf16, on `--device`) once for each
`--workers` count (the loader's threads): the whole model on the card, or with `--resident N` every MoE layer
tiered with N experts on the card and the rest in pinned host RAM. Also times one thread reading the files
through the page cache alone. Prints one JSON line per load; fails where a load reads faster than the page
cache was read in `--workers`' largest count of threads, or where a tensor differs from its file.

With `--serve "FLAGS"`, also starts `strata serve` on the checkpoint as a user would and polls /health: when
the server first answers (its loading page), the shares of the load it reported, and when it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.pinned import pin_by_registering
from app.loading import fill
from app.loading.checkpoint import CheckpointDir
from app.loading.loader import load_model
from benchmarks.random_checkpoint import write_random_checkpoint
from benchmarks.shapes import shape

READ_BYTES = 64 << 20


def page_cache_rate(files: list[Path], threads: int) -> float:
    """Bytes per second `threads` threads read `files` (split among them) with plain reads."""
    buffers = [bytearray(READ_BYTES) for _ in range(threads)]

    def read(index: int) -> None:
        view = memoryview(buffers[index])
        for path in files[index::threads]:
            with path.open("rb", buffering=0) as f:
                while f.readinto(view):
                    pass

    began = time.perf_counter()
    workers = [threading.Thread(target=read, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(path.stat().st_size for path in files) / (time.perf_counter() - began)


def check_against_file(model: torch.nn.Module, checkpoint: CheckpointDir) -> None:
    """The embedding and the last layer's first attention projection equal their tensors in the files."""
    for name in ("model.embed_tokens.weight", f"model.layers.{checkpoint.config.num_hidden_layers - 1}"):
        matches = [n for n in checkpoint.names() if n.startswith(name) and n.endswith("weight")]
        tensor_name = sorted(matches)[0]
        param = dict(model.named_parameters()).get(tensor_name)
        if param is not None and not torch.equal(param.cpu(), checkpoint.tensor(tensor_name)):
            raise SystemExit(f"{tensor_name} differs from its file after loading")


def serve_start(model: Path, flags: list[str], timeout: float = 300) -> dict:
    """Start `strata serve` on `model`, poll /health every 50 ms until it serves; the timeline seen."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", str(port), *flags]
    with tempfile.TemporaryFile() as log:
        began = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            seen = _poll_health(port, process, began, timeout)
        finally:
            process.terminate()
            process.wait(60)
        log.seek(0)
        said = log.read().decode(errors="replace").splitlines()
    if seen["serving_s"] is None:
        raise SystemExit("strata serve did not serve: " + " | ".join(said[-8:]))
    return seen


def _poll_health(port: int, process: subprocess.Popen, began: float, timeout: float) -> dict:
    """/health polled until the server serves (or exits, or `timeout` passes): when it first answered, the
    load shares it reported, when it served."""
    import httpx

    listening, shares, loaded_rates, served = None, [], [], None
    while time.perf_counter() - began < timeout and process.poll() is None:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        now = time.perf_counter() - began
        listening = listening if listening is not None else now
        if answer.status_code == 200:
            served = now
            break
        body = answer.json()
        if body.get("status") == "loading" and body.get("total_bytes"):
            shares.append(body["share"])
            loaded_rates.append(body["loaded_bytes"] / max(body["elapsed_s"], 1e-3))
        time.sleep(0.05)
    return {
        "listening_s": None if listening is None else round(listening, 2),
        "serving_s": None if served is None else round(served, 2),
        "load_shares_seen": len(shares),
        "last_share_seen": shares[-1] if shares else None,
        "reported_gb_per_s": round(max(loaded_rates) / 1e9, 2) if loaded_rates else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="q30-half")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--resident", type=int, help="experts a layer on the card (default: all)")
    parser.add_argument("--workers", type=int, nargs="+", default=[fill.worker_count()])
    parser.add_argument("--serve", metavar="FLAGS", help="also time strata serve with these flags")
    parser.add_argument("--driver-pinning", action="store_true", help="pin with cudaHostAlloc instead")
    args = parser.parse_args()
    if not args.driver_pinning:
        pin_by_registering()  # as the engine process does
    if not (args.dir / "model.safetensors.index.json").exists():
        began = time.perf_counter()
        written = write_random_checkpoint(args.dir, shape(args.shape, layers=args.layers))
        print(f"wrote {written / 1e9:.1f} GB in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    files = sorted(args.dir.glob("*.safetensors"))
    page_cache_rate(files, max(args.workers))  # brings every shard into the page cache
    cached = page_cache_rate(files, max(args.workers))
    one_thread = page_cache_rate(files, 1)
    checkpoint = CheckpointDir(args.dir)
    for workers in args.workers:
        fill.MAX_WORKERS = workers
        began = time.perf_counter()
        model, _ = load_model(
            args.dir, dtype="bfloat16", device=args.device, progress=False, resident_experts=args.resident
        )
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        loaded = sum(p.numel() * p.element_size() for p in model.parameters())
        check_against_file(model, checkpoint)
        rate = loaded / seconds
        line = {
            "shape": args.shape,
            "device": args.device,
            "resident": args.resident,
            "workers": workers,
            "pinning": "cudaHostAlloc" if args.driver_pinning else "registered",
            "cores": os.cpu_count(),
            "gb": round(loaded / 1e9, 2),
            "seconds": round(seconds, 2),
            "gb_per_s": round(rate / 1e9, 2),
            "page_cache_gb_per_s": round(cached / 1e9, 2),
            "page_cache_one_thread_gb_per_s": round(one_thread / 1e9, 2),
        }
        print(json.dumps(line), flush=True)
        if rate > 1.05 * cached:
            raise SystemExit(f"loaded at {rate / 1e9:.1f} GB/s, above the page cache's {cached / 1e9:.1f}")
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.serve is not None:
        flags = shlex.split(args.serve)
        line = {"shape": args.shape, "serve_flags": flags, **serve_start(args.dir, flags)}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
