"""The block-copy kernel (app/kernels/triton_blocks.py, in the interpreter on CPU): whole blocks of keys and
values copied by id pairs for each KV dtype (an engine streaming through it: tests/engine/test_kv_resident.py)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.kernels.triton_blocks import copy_blocks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_blocks_are_copied_whole_by_id_pairs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    row = 144 if dtype.itemsize == 1 else 64  # an 8-bit row: codes, scale and padding
    shape = (9, 16, 2, row)
    src = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
    dst = [torch.zeros((7, 16, 2, row), dtype=dtype) for _ in range(2)]
    sources, targets = torch.tensor([8, 0, 3, 3, 5]), torch.tensor([2, 6, 0, 1, 4])
    copy_blocks((src[0], src[1]), (dst[0], dst[1]), sources, targets)
    for kind in range(2):
        expected = torch.zeros_like(dst[kind])
        expected[targets] = src[kind][sources]
        assert torch.equal(dst[kind].view(torch.uint8), expected.view(torch.uint8))


def test_blocks_of_different_sizes_are_refused() -> None:
    a, b = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 32)
    with pytest.raises(ValueError, match="blocks of 2048 and 1024 words"):
        copy_blocks((a, a), (b, b), torch.tensor([0]), torch.tensor([1]))


def test_the_kernel_compiles_for_sm_90_with_every_read_16_bytes_wide() -> None:
    """Compiled for an H100/H200 on the CPU (the interpreter runs code the compiler refuses): a bf16 and an
    8-bit block each load as 16 four-word vectors a thread, keys and values (the whole block at once)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run([sys.executable, str(script), "blocks"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["blocks", "4096:16", "2304:16"]
