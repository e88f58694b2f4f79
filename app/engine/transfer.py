"""Host values to device tensors without making the host wait for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor on `device`, copied from pinned host memory behind the work already queued.

    A plain `torch.tensor(values, device=cuda)` copies from pageable memory and blocks the host until the
    device has finished everything queued before it; this returns at once, so the kernels that use the
    tensor can be queued behind a running window.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory on a GPU (see `device_tensor`)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
