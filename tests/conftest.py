"""Test-wide setup: without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the user cache
directory (parked conversations of the command line) is a fresh temporary one."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def _row_independent_dots() -> None:
    """Make the interpreter's `tl.dot` sum each output in float64 and round it once to float32.

    The interpreter computes `tl.dot` with numpy's matmul. Some of its BLAS kernels sum a row's products in
    an order that depends on how many rows the matrix has: OpenBLAS's kernels for AMD Zen do, its SkylakeX
    ones do not. A GPU's MMA never does, and the tests assert that a row's result does not depend on its
    window. Summed in float64 and rounded once, no order changes a float32 bit (short of a tie within
    2^-29 of a rounding boundary). The accumulator is then added as the interpreter adds it.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(
        self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
    ) -> Any:
        kinds = (np.float16, np.float32)
        if d.data.dtype != np.float32 or a.data.dtype not in kinds or b.data.dtype not in kinds:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if not torch.cuda.is_available():
    # Must be set before any module defines a Triton kernel: the interpreter is chosen at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _row_independent_dots()

# Servers and commands started by the tests inherit it: nothing they park lands in the user's own cache.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="strata-tests-cache-")
