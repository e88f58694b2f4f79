"""Single-sequence generation through the model's state path: read the prompt once, then one token a step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from app.errors import StrataError
from app.models.batch import ContiguousState, ForwardBatch
from app.models.qwen3 import CausalLM


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: temperature 0 is greedy; a seed makes sampling reproducible."""

    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        """Reject values no request may have, with a one-line message."""
        if self.max_tokens < 1:
            raise StrataError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise StrataError(f"temperature must be >= 0, got {self.temperature}")


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Pick a token from fp32 logits [vocab]: argmax at temperature 0, else a draw from softmax(logits/T)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_tokens(
    model: CausalLM, prompt: Sequence[int], params: SamplingParams, eos_token_ids: Sequence[int] = ()
) -> Iterator[int]:
    """Yield generated token ids one by one; stops after max_tokens or an eos id (which is yielded)."""
    params.validate()
    config = model.config
    if not prompt:
        raise StrataError("the prompt is empty")
    if any(not 0 <= t < config.vocab_size for t in prompt):
        raise StrataError(f"prompt token ids must lie in [0, {config.vocab_size})")
    if len(prompt) + params.max_tokens > config.max_position_embeddings:
        raise StrataError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
            f"context of {config.max_position_embeddings} tokens"
        )
    device = model.model.embed_tokens.weight.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    state = ContiguousState()
    chunk, past = list(prompt), 0
    for _ in range(params.max_tokens):
        batch = ForwardBatch.build([(0, chunk, past)], state, device)
        logits = model.logits(model(batch)[batch.last_rows()])[0]
        token = sample(logits, params.temperature, generator)
        yield token
        if token in eos_token_ids and not params.ignore_eos:
            return
        past += len(chunk)
        chunk = [token]
