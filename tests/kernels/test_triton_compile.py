"""The held-weight kernels compiled for an H100/H200 (sm_90) on the CPU: Triton's interpreter runs code that
the compiler refuses (a module-level int read inside a kernel, say), so each held type's programs are
compiled as the GPU would compile them (tests/kernels/sm90_compile.py, in a process without the
interpreter), and the width of held Q8_0's loads, which the interpreter cannot show, is read from the PTX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from app.kernels.triton_moe import HELD_CODES


def test_each_held_types_programs_compile_for_sm_90_and_q8_0s_codes_load_16_bytes_at_a_time() -> None:
    """Every held type compiles; over aligned rows held Q8_0's codes load as 16-byte vectors or 16-byte
    asynchronous copies, and only its scales (at most eight a step) two bytes at a time (in the file's
    layout every code loaded two bytes at a time: 34 loads a step of the row sums)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), *HELD_CODES, "q8_0-loads"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *held, loads = done.stdout.splitlines()
    assert [line.split()[0] for line in held] == list(HELD_CODES)
    for form in loads.split()[1:]:
        wide, narrow = map(int, form.split(":")[1].split("/")[:2])
        assert wide >= 4 and narrow <= 8, loads


def test_the_routing_in_one_launch_and_the_norm_summing_picks_compile_for_sm_90() -> None:
    """`_router_kernel` without and with the shared expert's program, and `_rms_norm_kernel` summing a
    block's eight picks, compiled as the GPU would compile them (the interpreter runs the tests' launches)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), "routing"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    forms = [form.split(":")[0] for form in done.stdout.split()[1:]]
    assert forms == ["router-shared-0", "router-shared-1", "norm-picks"]


def test_the_tier_hand_over_waiting_for_the_pool_compiles_for_sm_90_with_volatile_loads() -> None:
    """`_add_parts` with WAIT compiled as the GPU would compile it: the done word is read by volatile loads in
    a loop (a load the compiler could hoist out of it would spin forever on its first value), and so are the
    sums after it (never read ahead of the word)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), "tier-wait"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    name, volatile, branches = done.stdout.split()
    assert name == "tier-wait" and int(volatile) >= 3 and int(branches) >= 2, done.stdout
