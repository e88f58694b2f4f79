"""Memory-mapped safetensors reader: tensors are views of the mapped file, read only when touched."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from app.errors import StrataError
from app.loading.fill import Extent

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(StrataError):
    """A checkpoint file or directory is missing, corrupt, or does not match the model."""


class SafetensorsFile:
    """One .safetensors file, mapped once; `tensor(name)` returns a zero-copy CPU tensor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(header_len))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self._data_start = 8 + header_len
        self._size = size
        self._storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size) if size else None

    def names(self) -> list[str]:
        """Names of the tensors in the file."""
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor without touching its data."""
        return tuple(self.entries[name]["shape"])

    def extent(self, name: str) -> Extent:
        """Where the named tensor's bytes lie in the file (checked against its dtype and shape)."""
        entry = self.entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"unsupported dtype {entry['dtype']} of tensor {name} in {self.path}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > self._size - self._data_start:
            raise CheckpointError(
                f"tensor {name} in {self.path} has {end - begin} bytes for shape {list(shape)}"
            )
        return Extent(self.path, self._data_start + begin, end - begin, dtype, shape)

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor as a view of the mapped file."""
        extent = self.extent(name)
        dtype, shape, offset = extent.dtype, extent.shape, extent.offset
        if not extent.nbytes:
            return torch.empty(shape, dtype=dtype)
        if offset % dtype.itemsize:
            raw = torch.empty(0, dtype=torch.uint8).set_(self._storage, offset, (extent.nbytes,))
            return raw.clone().view(dtype).reshape(shape)
        return torch.empty(0, dtype=dtype).set_(self._storage, offset // dtype.itemsize, shape)
