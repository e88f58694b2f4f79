"""The held-weight kernels compiled for an H100/H200 (sm_90) on the CPU: Triton's interpreter runs code that
the compiler refuses (a module-level int read inside a kernel, say), so each held type's programs are
compiled as the GPU would compile them (tests/kernels/sm90_compile.py, in a process without the
interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.kernels.triton_moe import HELD_CODES


def test_each_held_types_programs_compile_for_sm_90() -> None:
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), *HELD_CODES], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert [line.split()[0] for line in done.stdout.splitlines()] == list(HELD_CODES)
