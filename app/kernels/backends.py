"""The backend interface: one function per hot operation, a registry, and the choice made at start.

Every backend set must agree with the pure-torch reference (`REFERENCE`), which runs on any device and is
what the tests compare fast kernels against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.errors import StrataError
from app.models.attention import causal_attention
from app.models.gdn import delta_rule_chunked, delta_rule_recurrent
from app.models.moe import experts_reference

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Backends:
    """The functions the model's layers call for their heavy work.

    attention(q [new, heads, d], k [total, kv_heads, d], v, scale) -> [new, heads, d] (causal, GQA);
    delta_rule_prompt / delta_rule_step(q, k, v, g, beta, state) -> (out, state), for prompt chunks and for
    single tokens; experts(x, top_ids, top_weights, gate_up, down) -> the weighted sum of routed experts.
    """

    name: str
    attention: AttentionFn
    delta_rule_prompt: DeltaRuleFn
    delta_rule_step: DeltaRuleFn
    experts: ExpertsFn


REFERENCE = Backends(
    name="torch",
    attention=causal_attention,
    delta_rule_prompt=delta_rule_chunked,
    delta_rule_step=delta_rule_recurrent,
    experts=experts_reference,
)

REGISTRY: dict[str, Callable[[torch.device], Backends | None]] = {
    "torch": lambda device: REFERENCE,
}


def select_backends(name: str, device: torch.device | str) -> Backends:
    """The named backend set, or with `auto` the first in the registry that runs on `device`."""
    device = torch.device(device)
    if name == "auto":
        for make in REGISTRY.values():
            backends = make(device)
            if backends is not None:
                return backends
    if name not in REGISTRY:
        raise StrataError(f"unknown backend {name!r}; choose one of auto, {', '.join(REGISTRY)}")
    backends = REGISTRY[name](device)
    if backends is None:
        raise StrataError(f"backend {name!r} does not run on {device.type}")
    return backends
