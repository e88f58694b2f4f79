"""HF transformers as the reference point: the same shape, random weights, timed in the same process.

`build_hf_model` constructs `Qwen3MoeForCausalLM` / `Qwen3NextForCausalLM` straight on the target device in
the target dtype (HF's own initialisation then runs there, which is quick on a GPU), so no full-size fp32
copy is ever made on the CPU. `hf_decode_tok_s` and `hf_prefill_tok_s` time greedy `generate` and a prompt
forward the way a user of plain transformers would run them: default attention and experts implementations,
and for Qwen3-Next the pure-torch Gated DeltaNet path unless the optional fast kernels are installed.
`run_reference` does all of it for one shape and frees the model afterwards; `smoke` checks the whole path
on tiny versions of every shape.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from benchmarks.roofline import bytes_per_step, measure_copy_bandwidth
    from benchmarks.shapes import SHAPES, param_counts, shape, tiny
except ImportError:  # run as a script from inside benchmarks/
    from roofline import bytes_per_step, measure_copy_bandwidth  # type: ignore[no-redef]
    from shapes import SHAPES, param_counts, shape, tiny  # type: ignore[no-redef]

_CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}

DEFAULT_NEW_TOKENS = 16
"""Generated tokens per timed `generate`: HF's MoE decode is slow, so a few steps are enough."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes, with the device synchronised before and after."""
    _sync(device)
    began = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - began


def hf_config(config_dict: dict[str, Any]) -> Any:
    """The HF config object (`Qwen3MoeConfig` / `Qwen3NextConfig`) of a config.json dict."""
    import transformers

    config_name, _ = _CLASSES[config_dict["model_type"]]
    return getattr(transformers, config_name).from_dict(dict(config_dict))


def build_hf_model(
    config_dict: dict[str, Any],
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    experts_implementation: str | None = None,
) -> torch.nn.Module:
    """An HF causal LM of this shape with random weights, built directly on `device` in `dtype`.

    Construction runs under `torch.device(device)` with `dtype` as the default dtype, so every weight is
    allocated on the device at its final dtype (the rotary `inv_freq` buffers stay fp32, as HF makes them)
    and HF's `_init_weights` (normal(0, initializer_range) for projections and experts, the usual constants
    for norms, A_log and dt_bias) runs there. Any tensor that still holds a non-finite value afterwards is
    refilled with normal(0, 0.02).
    `experts_implementation` (e.g. "eager", "grouped_mm") overrides HF's default choice when given.
    """
    import transformers

    device = torch.device(device)
    _, model_name = _CLASSES[config_dict["model_type"]]
    model_cls = getattr(transformers, model_name)
    config = hf_config(config_dict)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.eval().requires_grad_(False)
    _ensure_finite(model, std=0.02)
    if experts_implementation is not None and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(experts_implementation)
    eos = config.eos_token_id
    model.generation_config.pad_token_id = (eos[0] if eos else 0) if isinstance(eos, list) else (eos or 0)
    return model


def _ensure_finite(model: torch.nn.Module, std: float) -> int:
    """Refill floating tensors holding NaN/inf with normal(0, std); returns how many were refilled."""
    refilled = 0
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                tensor.normal_(0.0, std)
                refilled += 1
    return refilled


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _prompt(model: torch.nn.Module, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator)
    return ids.to(_model_device(model))


@dataclass(frozen=True)
class GenerateTiming:
    """One timed greedy `generate`: seconds to the first token's logits, then over the decode steps."""

    batch: int
    new_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        """Aggregate tokens/s of the decode steps: `batch * (new_tokens - 1) / decode_s`."""
        return self.batch * (self.new_tokens - 1) / self.decode_s


def hf_generate_timing(
    model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int = DEFAULT_NEW_TOKENS, seed: int = 0
) -> GenerateTiming:
    """Time one greedy `generate` of `new_tokens` tokens for `batch` random prompts of `prompt_len` tokens.

    A logits processor stamps the (synchronised) clock each time logits reach the sampler: the first stamp
    ends the prefill, which yields the first token, and the `new_tokens - 1` decode steps lie between the
    first and the last stamp. `generate` already synchronises every step to check its stopping criteria,
    so the stamps add no stall of their own. `min_new_tokens == max_new_tokens`: no sequence stops early.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    if new_tokens < 2:
        raise ValueError("new_tokens must be at least 2: the first token comes from the prefill")
    device = _model_device(model)
    ids = _prompt(model, batch, prompt_len, seed)
    stamps: list[float] = []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            _sync(device)
            stamps.append(time.perf_counter())
            return scores

    _sync(device)
    began = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.generation_config.pad_token_id,
        logits_processor=LogitsProcessorList([StepClock()]),
    )
    _sync(device)
    if out.shape != (batch, prompt_len + new_tokens) or len(stamps) != new_tokens:
        raise RuntimeError(
            f"generate made {tuple(out.shape)} with {len(stamps)} steps, "
            f"expected {(batch, prompt_len + new_tokens)} with {new_tokens}"
        )
    return GenerateTiming(batch, new_tokens, prefill_s=stamps[0] - began, decode_s=stamps[-1] - stamps[0])


def hf_decode_tok_s(
    model: torch.nn.Module,
    batch: int,
    prompt_len: int,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    seed: int = 0,
    repeats: int = 1,
) -> float:
    """Aggregate decode tokens/s of greedy `generate` for `batch` random prompts of `prompt_len` tokens.

    `batch * (new_tokens - 1)` tokens over the decode steps' time, the prefill excluded (see
    `hf_generate_timing`). One untimed warm-up `generate` of 2 tokens first; the median of `repeats` runs.
    """
    hf_generate_timing(model, batch, prompt_len, 2, seed)
    return statistics.median(
        hf_generate_timing(model, batch, prompt_len, new_tokens, seed).decode_tok_s for _ in range(repeats)
    )


def hf_prefill_tok_s(
    model: torch.nn.Module, prompt_len: int, batch: int = 1, seed: int = 0, repeats: int = 3
) -> float:
    """Prompt tokens/s of one forward over `batch` random prompts of `prompt_len` tokens.

    The forward builds the KV cache / recurrent states and computes only the last position's logits, as the
    prefill inside `generate` does. One untimed warm-up, then the median of `repeats` timed forwards.
    """
    device = _model_device(model)
    ids = _prompt(model, batch, prompt_len, seed)
    mask = torch.ones_like(ids)

    def forward() -> None:
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

    forward()
    seconds = statistics.median(_timed(device, forward) for _ in range(repeats))
    return batch * prompt_len / seconds


def free(model: torch.nn.Module) -> None:
    """Drop the model's device memory (parameters and buffers), so that another model can be loaded."""
    device = _model_device(model)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module._parameters[name] = None
            del param
        for name in list(module._buffers):
            module._buffers[name] = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_reference(
    config_dict: dict[str, Any],
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    batches: tuple[int, ...] = (1, 8, 32),
    prompt_len: int = 128,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    prefill_len: int = 2048,
) -> dict[str, Any]:
    """Build the HF model of this shape, time decode per batch size and one prefill, then free it.

    Returns `build_s`, `decode_tok_s` ({batch: tok/s}), `prefill_tok_s`, `prefill_len`, `prompt_len`,
    `new_tokens` and the attention / experts implementations HF picked.
    """
    device = torch.device(device)
    began = time.perf_counter()
    model = build_hf_model(config_dict, device, dtype)
    _sync(device)
    result: dict[str, Any] = {
        "build_s": time.perf_counter() - began,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_len": prefill_len,
        "decode_tok_s": {},
    }
    try:
        for batch in batches:
            result["decode_tok_s"][batch] = hf_decode_tok_s(model, batch, prompt_len, new_tokens)
        result["prefill_tok_s"] = hf_prefill_tok_s(model, prefill_len)
    finally:
        free(model)
        del model
    return result


def smoke(device: str | torch.device = "cpu") -> dict[str, dict[str, Any]]:
    """Run the whole reference path on a tiny version of every shape; returns the figures per shape.

    Checks that the built model has exactly the weights `param_counts` predicts, all finite, and that the
    decode / prefill timings and the roofline byte count come out positive and finite; then runs
    `run_reference` on tiny Qwen3-Next and a small `measure_copy_bandwidth` (keys `run_reference`, `copy`).
    """
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, dict[str, Any]] = {}
    for name in SHAPES:
        config = tiny(shape(name))
        model = build_hf_model(config, device, dtype)
        params = list(model.parameters())
        count = sum(p.numel() for p in params)
        if count != param_counts(config).total:
            raise AssertionError(
                f"{name}: HF has {count} weights, param_counts says {param_counts(config).total}"
            )
        if not all(bool(torch.isfinite(p).all()) for p in params):
            raise AssertionError(f"{name}: non-finite weights")
        if any(p.dtype != dtype or p.device.type != device.type for p in params):
            raise AssertionError(f"{name}: weights not all {dtype} on {device}")
        if any(b.dtype != torch.float32 for n, b in model.named_buffers() if n.endswith("inv_freq")):
            raise AssertionError(f"{name}: rotary inv_freq is not fp32")
        figures = {
            "layers": config["num_hidden_layers"],
            "params": count,
            "decode_tok_s_bs1": hf_decode_tok_s(model, batch=1, prompt_len=8, new_tokens=6),
            "decode_tok_s_bs4": hf_decode_tok_s(model, batch=4, prompt_len=8, new_tokens=6),
            "prefill_tok_s": hf_prefill_tok_s(model, prompt_len=64),
            "bytes_per_step_bs4": bytes_per_step(config, batch=4, context=8),
        }
        for key, value in figures.items():
            if not (math.isfinite(value) and value > 0):
                raise AssertionError(f"{name}: {key} = {value}")
        free(model)
        if any(True for _ in model.parameters()):
            raise AssertionError(f"{name}: free() left parameters behind")
        results[name] = figures
    results["run_reference"] = run_reference(
        tiny(shape("qnext")), device, dtype, batches=(1, 2), prompt_len=8, new_tokens=4, prefill_len=32
    )
    copy = measure_copy_bandwidth(device, size_bytes=64 * 1024**2, repeats=5, warmup=1)
    if not (math.isfinite(copy) and copy > 0):
        raise AssertionError(f"copy bandwidth {copy}")
    results["copy"] = {"bytes_per_s": copy}
    return results


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 1)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    return value


if __name__ == "__main__":
    for shape_name, figures in smoke().items():
        print(shape_name, _rounded(figures))
