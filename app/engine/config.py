"""Engine settings, chosen once at start (CLI options map onto these fields)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import platformdirs

GIB = 1 << 30
PARK_MEMORY = GIB  # the command line's defaults for parking (an EngineConfig parks only when asked)
PARK_DISK = 8 * GIB
WINDOW_TOKENS = 2048  # a window's token budget by default
# ... and where an expert tier copies host experts over PCIe: a prompt window copies nearly every host expert
# of every layer whatever its rows (a 2K-token chunk touches every expert), so its time is mostly a fixed cost
# that fewer, larger windows pay less often (docs/BATCHING.md)
STREAMED_WINDOW_TOKENS = 8192


def default_park_dir() -> Path:
    """Where the command line parks conversations by default: in the user cache directory."""
    return Path(platformdirs.user_cache_dir("strata")) / "parked"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine process loads and how it batches.

    `model` is an HF directory (None: the default demo model); `device` is cpu, cuda, or auto (cuda when
    available). `parallel` is the number of batch slots; `max_batched_tokens` the token budget of one window
    (None: `window_tokens` picks it);
    `kv_memory` the bytes of the KV pool and per-slot recurrent state; `kv_dtype` how keys and values are kept
    (auto: the activations' dtype; bf16; fp8 or int8: 8-bit codes with a scale a token and head,
    app/kernels/kv_quant.py); `kv_resident` tokens of the pool's blocks live on the device, the rest in host
    RAM, streamed in for attention layer by layer (None: the whole pool on the device;
    app/engine/kv_stream.py); `decode_share` the share of its solo speed a decoding slot keeps while peers'
    prompts are read (docs/BATCHING.md); `backend` names the compute backends (app/kernels), `auto` picks for
    the device; `exact` fixes the kernels' tiles for every window size, dense projections included
    (docs/KERNELS.md); `enforce_eager` turns off CUDA graphs of windows; `overlap` plans and queues each
    window while the device runs the one before (docs/BATCHING.md); `prefix_cache` lets requests continue from
    cached KV blocks and saved recurrent states (docs/BATCHING.md); `park_memory` bytes of host RAM hold
    finished turns for their follow-ups, and with `park_dir` up to `park_disk` bytes of files (surviving
    restarts); `expert_cache` experts of each MoE layer live on the device (or as many as `expert_vram` bytes
    hold; `expert_placement` "layers" gathers that budget into whole layers instead), the rest in host RAM
    (None: every expert on the device; app/models/expert_tier.py), each window's misses computed on the CPU or
    copied over PCIe as the measured costs say (`pcie_frac` forces that share over PCIe), and every
    `adapt_every` windows the most routed experts become the resident ones (0: the tier stays frozen), their
    copies queued before the next window or, with `adapt_async`, made on a side stream while windows run.
    `layer_split` cuts the decoder layers into stages, one process each (app/engine/split.py): `auto`, a
    stage count, or each stage's layer count ("20,28"); None runs the model whole in the engine process.
    `batch_groups` slot groups take turns down a split's stages, each window one group's (None: one group
    per stage on GPUs, one on a CPU). The stages of `remote_stages` are not started here: they join from
    other hosts (`strata stage`) at `split_rendezvous` (tcp://HOST:PORT, where this engine listens).
    `spec` drafts tokens for decoding requests (`ngram`: prompt lookup in the conversation;
    app/engine/drafts.py; `mtp`: the model's MTP head, app/engine/mtp_drafts.py), up to `spec_tokens` a
    window, verified in the window beside every other row; "off" drafts none (a request may still ask for
    n-gram drafts with its own `spec_tokens`).
    `stage_gpus` names each stage's GPU on this host (empty: stage k on GPU k); stage 0 runs on GPU 0, and
    stages may share a card (their tensors then travel through host memory).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    parallel: int = 8
    max_batched_tokens: int | None = None
    block_size: int = 16
    kv_memory: int = 2 * GIB
    kv_dtype: str = "auto"
    kv_resident: int | None = None
    decode_share: float = 0.5
    max_model_len: int | None = None
    backend: str = "auto"
    exact: bool = False
    enforce_eager: bool = False
    overlap: bool = True
    prefix_cache: bool = True
    park_memory: int = 0
    park_dir: str | None = None
    park_disk: int = 0
    seed: int = 0
    expert_cache: int | None = None
    expert_vram: int | None = None
    expert_placement: str = "spread"
    adapt_every: int = 32
    pcie_frac: float | None = None
    adapt_async: bool = False
    layer_split: str | None = None
    batch_groups: int | None = None
    split_rendezvous: str | None = None
    remote_stages: tuple[int, ...] = ()
    stage_gpus: tuple[int, ...] = ()
    spec: str = "off"
    spec_tokens: int = 3

    def window_tokens(self, staged: bool) -> int:
        """The token budget of a window: `max_batched_tokens` where given, else WINDOW_TOKENS, or
        STREAMED_WINDOW_TOKENS where an expert tier copies host experts over PCIe (`staged`: a tier has a
        staging area on a GPU, and `pcie_frac` does not keep every miss on the CPU)."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        copies = staged and self.pcie_frac != 0.0
        return STREAMED_WINDOW_TOKENS if copies else WINDOW_TOKENS
