"""Times the Gated DeltaNet prompt kernels at Qwen3-Next-80B-A3B's linear-attention sizes.

    python benchmarks/gdn_prompt.py [--tokens 8192]

One prompt of `tokens` rows through the delta rule: the chunked kernels (`gated_delta_rule_paged`, the
engine's prompt path) under several precision, warp and tile choices, against the token-by-token kernel
(`gated_delta_rule_varlen`). Each choice also reports its largest difference from the fp32 token-by-token
torch reference on the first 1,024 rows. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.kernels import triton_gdn
from app.kernels.reference import delta_rule_recurrent
from app.models.batch import PagedLayout
from app.models.gdn import l2norm

K_HEADS, V_HEADS, DK, DV = 16, 32, 128, 128
CHECK_ROWS = 1024
CHOICES = {  # module settings of app/kernels/triton_gdn.py to try, over its defaults
    "defaults": {},
    "solve tf32": {"SOLVE_PRECISION": "tf32"},
    "solve ieee": {"SOLVE_PRECISION": "ieee"},
    "prepare w4": {"PREPARE_WARPS": 4},
    "carry v64 w8": {"CARRY_BLOCK_V": 64, "CARRY_WARPS": 8},
    "carry v16": {"CARRY_BLOCK_V": 16},
}


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device="cuda")

    q, k = randn(tokens, K_HEADS, DK).bfloat16(), randn(tokens, K_HEADS, DK).bfloat16()
    v = randn(tokens, V_HEADS, DV).bfloat16()
    g = -F.softplus(randn(tokens, V_HEADS) - 1.0)
    beta = randn(tokens, V_HEADS).sigmoid()
    return q, k, v, g, beta


def _layout(tokens: int) -> PagedLayout:
    def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device="cuda")

    return PagedLayout(
        query_start=ints([0, tokens], torch.int32),
        seq_lens=ints([tokens], torch.int32),
        block_table=ints([[0]], torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        state_slots=ints([0], torch.int64),
        max_query_len=tokens,
    )


def _time_ms(run: Callable[[], object], repeats: int = 5) -> float:
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    q, k, v, g, beta = _inputs(args.tokens)
    state = torch.zeros(1, V_HEADS, DK, DV, device="cuda")
    layout = _layout(args.tokens)
    per = V_HEADS // K_HEADS
    rows = slice(0, CHECK_ROWS)
    expected, _ = delta_rule_recurrent(
        l2norm(q[rows].float()).repeat_interleave(per, dim=1) * DK**-0.5,
        l2norm(k[rows].float()).repeat_interleave(per, dim=1),
        v[rows].float(),
        g[rows],
        beta[rows],
        state[0].clone(),
    )
    results: dict[str, object] = {"tokens": args.tokens, "device": torch.cuda.get_device_name()}
    names = {setting for overrides in CHOICES.values() for setting in overrides}
    defaults = {name: getattr(triton_gdn, name) for name in names}
    sequential = _time_ms(
        lambda: triton_gdn.gated_delta_rule_varlen(
            q, k, v, g, beta, state.clone(), layout.query_start, layout.state_slots
        )
    )
    results["token_by_token_ms"] = round(sequential, 3)
    print(f"token by token: {sequential:.3f} ms", flush=True)
    for name, overrides in CHOICES.items():
        for setting, value in {**defaults, **overrides}.items():
            setattr(triton_gdn, setting, value)
        out = triton_gdn.gated_delta_rule_paged(q, k, v, g, beta, state.clone(), layout)
        error = (out[rows] - expected).abs().max().item()
        ms = _time_ms(lambda: triton_gdn.gated_delta_rule_paged(q, k, v, g, beta, state.clone(), layout))
        results[name] = {"ms": round(ms, 3), "max_abs_error": error}
        print(f"chunked {name}: {ms:.3f} ms, max |error| {error:.2e}", flush=True)
    for name, value in defaults.items():
        setattr(triton_gdn, name, value)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        triton_gdn.gated_delta_rule_paged(q, k, v, g, beta, state.clone(), layout)
        torch.cuda.synchronize()
    for event in profile.key_averages():
        if "chunk" in event.key:
            results[f"defaults: {event.key} ms"] = round(event.device_time_total / 1000, 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
