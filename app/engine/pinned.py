"""How this process pins host memory: pages allocated and touched by several threads, then registered with
CUDA (`cudaHostRegister`), rather than allocated page-locked by the driver.

Pinned host RAM holds the expert tier's experts, the loader's staging buffers and parked conversations. The
driver's own page-locked allocation (`cudaHostAlloc`, torch's default) ran at about 1.1 GiB/s on the H200
machine, 10 s for the 11 GiB of experts a tiered Qwen3-30B-A3B keeps in RAM; registering memory that threads
have touched ran at about 18 GiB/s. torch's pinned allocator does the latter with
`pinned_use_cuda_host_register` (PYTORCH_CUDA_ALLOC_CONF), set before CUDA starts in the process.
"""

from __future__ import annotations

import os

REGISTER_THREADS = 8
PINNED_BY_REGISTER = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{REGISTER_THREADS}"


def pin_by_registering() -> None:
    """Make torch pin host memory by registering it (before CUDA starts); a PYTORCH_CUDA_ALLOC_CONF the user
    set that already says how to pin is left as it is."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_" in conf:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{conf},{PINNED_BY_REGISTER}" if conf else PINNED_BY_REGISTER
