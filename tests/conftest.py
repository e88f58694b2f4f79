"""Test-wide setup: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the user cache
directory (parked conversations of the command line) is a fresh temporary one."""

from __future__ import annotations

import os
import tempfile

import torch

if not torch.cuda.is_available():
    # Must be set before any module defines a Triton kernel: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers and commands started by the tests inherit it: nothing they park lands in the user's own cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="strata-tests-cache-")
