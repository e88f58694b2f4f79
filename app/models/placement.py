"""How a budget of experts on the device is laid over a model's MoE layers (the expert tier's placement).

Pure Python, so the command line can name the choices without loading torch.
"""

from __future__ import annotations

PLACEMENTS = ("spread", "layers")  # how a budget of resident experts is laid over the MoE layers


def layer_residency(budget: int, layers: int, experts: int, placement: str) -> list[int]:
    """Experts on the device for each of `layers` MoE layers of `experts` (in model order) from `budget`
    experts in all. `spread`: every layer the same number (what suits routing that favours some experts in
    each layer: each keeps its hot ones); `layers`: whole layers first, the remainder in the next one, none in
    the rest (what suits routing spread evenly: only a few layers stop for misses, as with llama.cpp's
    expert layers on the CPU). A layer given all its experts has no tier."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {placement!r}")
    budget = max(0, min(budget, layers * experts))
    if placement == "spread":
        return [budget // layers] * layers
    full, rest = divmod(budget, experts)
    return [experts] * full + ([rest] if full < layers else []) + [0] * max(layers - full - 1, 0)


def spare_slots(resident: int) -> int:
    """Device slots an asynchronously adapting tier keeps free for the experts being copied in: a quarter of
    its resident ones, 1 to 8 (so many swaps land per round)."""
    return max(1, min(8, resident // 4)) if resident else 0
