"""native/held_experts.cu compiled by NVRTC for sm_90 on the CPU, as `cuda_held` compiles it on a card: with
the source's own choices and with each define the tuner tries. The library comes from the nvidia-cuda-nvrtc
wheel (a test dependency); a card's compile uses the one the CUDA build of PyTorch brings. The GPU runs the
kernels themselves (tests/gpu/test_cuda_held_gpu.py); this catches a source NVRTC refuses where CI runs."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest

from app.kernels import cuda_held


def _nvrtc() -> ctypes.CDLL | None:
    """The wheel's NVRTC library, if installed (its builtins loaded first: NVRTC opens them by name, which
    then finds them loaded)."""
    spec = importlib.util.find_spec("nvidia")
    for folder in spec.submodule_search_locations or [] if spec else []:
        for library in sorted(Path(folder).glob("**/lib/libnvrtc.so.*")):
            for builtins in library.parent.glob("libnvrtc-builtins.so.*"):
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(library))
    return None


@pytest.mark.parametrize(
    "defines",
    [{}, {"Q8_HALF": "0", "STAGES": "3", "MIN_BLOCKS": "3"}, {"DENSE_STAGES": "5", "DOWN_STAGES": "4"}],
)
def test_the_held_kernels_compile_for_sm_90(defines: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("no NVRTC library: install the test dependencies (nvidia-cuda-nvrtc)")
    monkeypatch.setattr(cuda_held, "DEFINES", defines)
    binary = cuda_held._compile(cuda_held._source(), "sm_90", nvrtc)
    assert binary[:4] == b"\x7fELF"  # a cubin
    assert all(name.encode() in binary for name in cuda_held.KERNELS)  # every kernel the launches name
