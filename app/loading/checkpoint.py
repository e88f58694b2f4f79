"""An HF model directory: config.json, generation_config.json, and the safetensors tensors of every shard."""

from __future__ import annotations

from pathlib import Path

import torch

from app.jsonfile import directory_eos_ids, read_json_object
from app.loading.fill import Extent
from app.loading.gguf_file import GGUFCheckpoint, is_gguf
from app.loading.random_weights import RandomWeights, is_random_weights
from app.loading.safetensors import CheckpointError, SafetensorsFile
from app.models.config import ConfigError, ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointDir:
    """The files of one HF model directory, opened lazily (tensors are memory-mapped views)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"model directory {self.path} does not exist")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{self.path} has no config.json")
        self.raw_config = read_json_object(config_path)
        self.config = ModelConfig.from_dict(self.raw_config)
        self._files: dict[str, SafetensorsFile] = {}
        self._where = self._tensor_files()

    def _tensor_files(self) -> dict[str, str]:
        """Tensor name -> shard file name, from the index or the single file."""
        index = self.path / INDEX
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise CheckpointError(f"shard {shard} listed in {INDEX} is missing from {self.path}")
            return dict(weight_map)
        if (self.path / SINGLE).is_file():
            return dict.fromkeys(self._open(SINGLE).names(), SINGLE)
        raise CheckpointError(f"{self.path} has neither {SINGLE} nor {INDEX}")

    def _open(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(self.path / name)
        return self._files[name]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from its file header."""
        file = self._open(self._where[name])
        if name not in file.entries:
            raise CheckpointError(f"tensor {name} is listed in {INDEX} but missing from {file.path.name}")
        return file.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as a memory-mapped CPU view."""
        self.shape(name)
        return self._open(self._where[name]).tensor(name)

    def extent(self, name: str) -> Extent:
        """Where a tensor's bytes lie in its shard, for reading them in parallel (app/loading/fill.py)."""
        self.shape(name)
        return self._open(self._where[name]).extent(name)

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from generation_config.json, then config.json, without repeats."""
        return directory_eos_ids(self.path, self.config.eos_token_ids)


Checkpoint = CheckpointDir | GGUFCheckpoint | RandomWeights  # what the loader reads tensors from


def open_checkpoint(path: Path | str) -> Checkpoint:
    """The model at `path`: a GGUF file (by its suffix), a directory of weights drawn as they load
    (`random_weights.json`), or an HF directory."""
    if is_gguf(path):
        return GGUFCheckpoint(path)
    return RandomWeights(path) if is_random_weights(path) else CheckpointDir(path)
