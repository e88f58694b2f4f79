"""Times paged attention over bf16 and 8-bit caches at q30's head shapes under several tile choices (replayed
from CUDA graphs): a lone decode row at 32K and 128K keys, and an 8K-row prompt chunk after 24K keys.

    python benchmarks/tune_kv_attention.py [--kinds bf16 int8 fp8]

Each line gives the time and the KV bytes read over it (a decode row reads its sequence's keys and values
once; a prompt chunk's figure counts them once too, so it is a floor, not what the tiles re-read). The
tiles of app/kernels/triton_attention.py (`tile_config`) come from these lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels import kv_quant
from app.kernels.triton_attention import TileConfig, _paged_attention, tile_config
from app.models.batch import PagedLayout
from benchmarks.roofline import replayed_ms

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16
CASES = {"decode 32K": (32768, 1), "decode 128K": (131072, 1), "prompt 8K after 24K": (24576, 8192)}
KINDS = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _case(
    past: int, new: int, kind: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedLayout]:
    total = past + new
    blocks = -(-total // BLOCK)
    width = kv_quant.row_width(HEAD_DIM, kind)
    gen = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device="cuda")
    keys = kv_quant.quantize(raw, kind) if kv_quant.quantized(kind) else raw.to(kind)
    values = kv_quant.quantize(raw.flip(0), kind) if kv_quant.quantized(kind) else raw.flip(0).to(kind)
    assert keys.shape[-1] == width
    layout = PagedLayout(
        query_start=torch.tensor([0, new], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([total], dtype=torch.int32, device="cuda"),
        block_table=torch.randperm(blocks, generator=gen, device="cuda").int()[None],
        slot_mapping=torch.zeros(new, dtype=torch.long, device="cuda"),
        state_slots=torch.zeros(1, dtype=torch.long, device="cuda"),
        max_query_len=new,
    )
    q = torch.randn(new, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    return q, keys, values, layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    args = parser.parse_args()
    base = tile_config(HEAD_DIM, HEADS // KV_HEADS, 2)
    variants = {
        "default": base,
        "dec_kv 64": TileConfig(base.block_m, base.block_kv, 64, base.splits, base.warps, base.stages),
        "stages 3": TileConfig(base.block_m, base.block_kv, base.dec_kv, base.splits, base.warps, 3),
        "warps 4": TileConfig(base.block_m, base.block_kv, base.dec_kv, base.splits, 4, base.stages),
        "splits 64": TileConfig(base.block_m, base.block_kv, base.dec_kv, 64, base.warps, base.stages),
    }
    for name, (past, new) in CASES.items():
        for kind in args.kinds:
            inputs = _case(past, new, KINDS[kind])
            keys = inputs[1]
            moved = 2 * (past + new) * KV_HEADS * keys.shape[-1] * keys.element_size()
            for label, config in variants.items():
                if new > 1 and label in ("dec_kv 64", "splits 64"):
                    continue
                ms = replayed_ms([lambda c=config, a=inputs: _paged_attention(*a, 0.088, c)])
                print(
                    f"{name:20s} {kind:5s} {label:10s} {ms * 1000:9.1f} us {moved / ms / 1e9:6.2f} TB/s",
                    flush=True,
                )
            del inputs, keys
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
