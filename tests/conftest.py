"""Test-wide setup: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any module defines a Triton kernel: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
