"""The park file: one parked conversation on disk, written and read back with every check.

Layout: MAGIC, the JSON header's length (8 bytes, little-endian), the JSON header (model identity, block size,
token ids, each tensor's name, shape, dtype and offset, a blake2b checksum of the payload), then the payload:
the tensors' bytes back to back.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"STRATA-PARKED-1\n"
SUFFIX = ".park"
PARTIAL = ".partial"  # a file being written; renamed to SUFFIX once whole
OWNER_ONLY = 0o600  # parked conversations hold users' prompts and answers


@dataclass(frozen=True)
class Part:
    """One tensor of a park file: its `shape` and `dtype`, stored as the bytes of `pieces` back to back (a
    stacked tensor may be written from its slices)."""

    name: str
    shape: list[int]
    dtype: torch.dtype
    pieces: list[torch.Tensor]


def file_name(tokens: list[int]) -> str:
    """The file a conversation of these token ids is parked in."""
    return hashlib.blake2b(json.dumps(tokens).encode(), digest_size=16).hexdigest() + SUFFIX


def write(path: Path, identity: str, block_size: int, tokens: list[int], parts: list[Part]) -> None:
    """Write a park file from host tensors, readable by its owner only, on the disk when this returns (fsync).

    The bytes go from the tensors to the checksum and the file without being copied or joined: hashing and
    writing large buffers release the GIL, so an engine's loop runs on beside the thread that writes.
    """
    digest, entries, offset, views = hashlib.blake2b(digest_size=32), [], 0, []
    for part in parts:
        entries.append({"name": part.name, "shape": part.shape, "dtype": str(part.dtype), "offset": offset})
        for piece in part.pieces:
            if piece.numel():
                view = memoryview(piece.contiguous().view(torch.uint8).numpy())
                digest.update(view)
                views.append(view)
                offset += view.nbytes
    header = {
        "model": identity,
        "block_size": block_size,
        "tokens": tokens,
        "tensors": entries,
        "checksum": digest.hexdigest(),
    }
    body = json.dumps(header).encode()
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, OWNER_ONLY), "wb") as f:
        f.write(MAGIC + len(body).to_bytes(8, "little") + body)
        for view in views:
            f.write(view)
        f.flush()
        os.fsync(f.fileno())


def read(
    path: Path, identity: str, block_size: int, tokens: tuple[int, ...], expected: dict[str, Part]
) -> dict[str, torch.Tensor]:
    """The tensors of a park file, after every check: format, model identity, block size, token ids,
    checksum, and each tensor's shape and dtype against `expected` (whose pieces are not used). Raises
    ValueError (or OSError) naming what is wrong."""
    header, payload = _checked(path, identity, block_size, tokens)
    entries = {e["name"]: e for e in header["tensors"]}
    if {n: entries[n]["shape"] for n in entries} != {n: part.shape for n, part in expected.items()}:
        raise ValueError("its tensor shapes do not fit this model")
    loaded = {}
    for name, part in expected.items():
        entry = entries[name]
        if entry["dtype"] != str(part.dtype):
            raise ValueError(f"{name} is {entry['dtype']}, not {part.dtype}")
        count = 1
        for n in part.shape:
            count *= n
        nbytes = count * torch.empty((), dtype=part.dtype).element_size()
        raw = bytearray(payload[entry["offset"] : entry["offset"] + nbytes])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        loaded[name] = flat.view(part.dtype).view(part.shape)
    return loaded


def verify(path: Path, identity: str, block_size: int, tokens: tuple[int, ...]) -> None:
    """Every check of `read` but the tensors' shapes, which `identity` fixes (another stage's file of a layer
    split, whose shapes this process does not hold). Raises ValueError (or OSError) naming what is wrong."""
    _checked(path, identity, block_size, tokens)


def _checked(path: Path, identity: str, block_size: int, tokens: tuple[int, ...]) -> tuple[dict, memoryview]:
    """A whole park file's header and payload, the header's fields and the payload's checksum checked."""
    data = path.read_bytes()
    header = parse_header(data)
    if header["model"] != identity:
        raise ValueError("it was parked by another model")
    if header["block_size"] != block_size:
        raise ValueError(f"block size {header['block_size']}, not {block_size}")
    if tuple(header["tokens"]) != tokens:
        raise ValueError("its token ids are not the ones it was indexed under")
    start = len(MAGIC) + 8 + int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    payload = memoryview(data)[start:]
    if hashlib.blake2b(payload, digest_size=32).hexdigest() != header["checksum"]:
        raise ValueError("checksum mismatch")
    return header, payload


def read_header(path: Path) -> dict:
    """The header of a park file, reading no more of it."""
    with path.open("rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise ValueError("not a parked-conversation file")
        length = int.from_bytes(head[len(MAGIC) :], "little")
        return parse_header(head + f.read(length))


def parse_header(data: bytes) -> dict:
    """The header at the start of `data` (a whole file, or its head), checked for its fields."""
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a parked-conversation file")
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    body = data[len(MAGIC) + 8 : len(MAGIC) + 8 + length]
    if len(body) != length:
        raise ValueError("truncated header")
    try:
        header = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"unreadable header: {e}") from e
    if (
        not isinstance(header, dict)
        or not {"model", "block_size", "tokens", "tensors", "checksum"} <= header.keys()
    ):
        raise ValueError("incomplete header")
    return header
