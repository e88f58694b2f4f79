"""Everything needed to run one model directory: weights, tokenizer, end-of-sequence ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from app.kernels.interface import Backends
from app.kernels.reference import REFERENCE
from app.loading.checkpoint import Checkpoint
from app.loading.gguf_file import is_gguf, model_name
from app.loading.loader import load_model
from app.models.qwen3 import CausalLM, ModelPart
from app.text.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready to run, with the files it came from."""

    model: CausalLM
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    eos_token_ids: tuple[int, ...]
    device: torch.device

    @property
    def name(self) -> str:
        """The model's name as users see it: its directory's name, or its GGUF file's without the suffix."""
        path = self.checkpoint.path
        return model_name(path) if is_gguf(path) else path.name


def open_model(
    path: Path | str,
    dtype: str = "auto",
    device: str = "cpu",
    progress: bool = True,
    backends: Backends = REFERENCE,
    resident_experts: int | None = None,
    spare_experts: int = 0,
    part: ModelPart | None = None,
    placement: str = "spread",
) -> LoadedModel:
    """Load weights and tokenizer of an HF directory; eos ids from the configs, else the tokenizer's eos."""
    model, checkpoint = load_model(
        path,
        dtype=dtype,
        device=device,
        progress=progress,
        backends=backends,
        resident_experts=resident_experts,
        spare_experts=spare_experts,
        part=part,
        placement=placement,
    )
    tokenizer = Tokenizer.load(checkpoint.path)
    eos = checkpoint.eos_token_ids()
    if not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    return LoadedModel(model, tokenizer, checkpoint, eos, torch.device(device))
