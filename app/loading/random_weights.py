"""A model directory whose weights are drawn as they load: config.json, a tokenizer and `random_weights.json`,
no weight files.

For benchmarks of shapes larger than a disk holds (Qwen3-Next-80B-A3B's 48 layers are 160 GB in bf16, a GPU
machine's disk 64 GB): `strata serve`, `strata bench` and every stage of a layer split load such a directory
as they would its checkpoint, each drawing the same tensors. A tensor is bf16, drawn from its name and the
marker's seed: a large one is a stretch of one base of N(0, 0.02) values starting where its name says
(weights whose values matter only through their statistics: projections, experts, embeddings); a small one
is drawn whole as `benchmarks/random_checkpoint.py` draws every tensor it writes (`draw`: the Gated DeltaNet
decays in the ranges trained models have, norms as initialised).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from app.jsonfile import directory_eos_ids, read_json_object
from app.kernels.reference import REFERENCE
from app.models.config import ModelConfig
from app.models.qwen3 import CausalLM

MARKER = "random_weights.json"
BASE_ELEMENTS = 1 << 24  # the shared base of large tensors (32 MB of bf16)
DRAWN_WHOLE = 1 << 16  # tensors of at most this many values are drawn whole (by default)


def is_random_weights(path: Path | str) -> bool:
    """Whether `path` is a directory of weights drawn as they load."""
    return (Path(path) / MARKER).is_file()


def write_marker(path: Path, seed: int = 0, drawn_whole: int = DRAWN_WHOLE) -> None:
    """Make the directory at `path` (config.json and a tokenizer written already) one of weights drawn as
    they load, from `seed`, tensors of at most `drawn_whole` values drawn whole."""
    (path / MARKER).write_text(json.dumps({"seed": seed, "drawn_whole": drawn_whole}))


def tensor_shapes(config: ModelConfig, mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of this config, by name, with its shape."""
    from app.loading.loader import tensor_sources

    with torch.device("meta"):
        model = CausalLM(config, mtp_layers=mtp_layers, backends=REFERENCE)
    params = dict(model.named_parameters())
    return {
        name: tuple(params[source.param][source.index].shape)
        for name, source in tensor_sources(model).items()
    }


def draw(name: str, shape: tuple[int, ...], offset_norm: bool, generator: torch.Generator) -> torch.Tensor:
    """A tensor as a random checkpoint holds it (fp32, on the generator's device): the Gated DeltaNet decays'
    logs uniform in log(1..16), their biases 1, norms as initialised (0 for Qwen3-Next's 1 + w norms), the
    rest N(0, 0.02)."""
    device = generator.device
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1, 16, generator=generator).log()
    if name.endswith("dt_bias"):
        return torch.ones(shape, device=device)
    if len(shape) == 1 and "norm" in name:
        return torch.zeros(shape, device=device) if offset_norm else torch.ones(shape, device=device)
    return torch.empty(shape, device=device).normal_(0.0, 0.02, generator=generator)


class RandomWeights:
    """The tensors of a directory of weights drawn as they load (the loader's `Checkpoint` interface, without
    extents: each tensor is drawn when read)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.raw_config = read_json_object(self.path / "config.json")
        self.config = ModelConfig.from_dict(self.raw_config)
        marker = read_json_object(self.path / MARKER)
        self.seed = int(marker.get("seed", 0))
        self.drawn_whole = int(marker.get("drawn_whole", DRAWN_WHOLE))
        next_layers = int(self.raw_config.get("num_nextn_predict_layers", 0))
        self._shapes = tensor_shapes(
            self.config, next_layers if self.config.model_type == "qwen3_next" else 0
        )
        self._base: torch.Tensor | None = None

    def names(self) -> list[str]:
        """Every tensor name of the model."""
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` in bf16 on the host, the same at every read and in every process."""
        shape = self._shapes[name]
        numel = 1
        for size in shape:
            numel *= size
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if numel <= self.drawn_whole:
            return draw(name, shape, self.config.offset_norm, generator).to(torch.bfloat16)
        base = self._shared_base()
        start = int(torch.randint(0, BASE_ELEMENTS, (1,), generator=generator))
        turns = -(-(start + numel) // BASE_ELEMENTS)
        stretch = base.repeat(turns) if turns > 1 else base  # a copy, or the base itself: copied below
        return stretch[start : start + numel].view(shape).clone()

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype `tensor(name)` has (bf16), without drawing it."""
        return torch.bfloat16

    def _shared_base(self) -> torch.Tensor:
        if self._base is None:
            generator = torch.Generator().manual_seed(self.seed)
            self._base = torch.empty(BASE_ELEMENTS).normal_(0.0, 0.02, generator=generator).to(torch.bfloat16)
        return self._base

    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from generation_config.json, then config.json, without repeats."""
        return directory_eos_ids(self.path, self.config.eos_token_ids)
