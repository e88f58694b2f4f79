"""A model directory's fingerprint, checked before state saved by one model is used by another."""

from __future__ import annotations

import hashlib
from pathlib import Path

from app.loading.gguf_file import gguf_shards
from app.loading.random_weights import MARKER

SAMPLE = 1 << 16  # bytes read from each end of a weight file


def model_identity(path: Path) -> str:
    """A fingerprint of a model: a directory's config and, per weight file, name, size and both ends (a GGUF
    file: the same of each of its files, whose metadata is its config)."""
    digest = hashlib.blake2b(digest_size=16)
    if path.is_file():
        files = gguf_shards(path)
    else:
        digest.update((path / "config.json").read_bytes())
        files = sorted([*path.glob("*.safetensors"), *path.glob("*.gguf"), *path.glob(MARKER)])
    for weights in files:
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(SAMPLE))
            f.seek(max(size - SAMPLE, 0))
            digest.update(f.read(SAMPLE))
    return digest.hexdigest()
