"""Routed experts held as Q4_K or Q8_0 blocks in windows of up to DECODE_TOKENS tokens, on the tensor cores:
the CUDA C kernels of native/held_experts.cu, compiled at first use on the device by NVRTC (the library that
CUDA builds of PyTorch bring) and launched through the driver.

`expert_pairs` has `triton_moe.expert_pairs`'s contract and `linear` multiplies by a dense held weight; each
returns None where it does not apply (no CUDA device or no NVRTC, activations not bf16, other quant types,
shapes the kernels do not tile, a window of more than DECODE_TOKENS tokens), and the caller then runs the
Triton kernels. A pair's result does not depend on the other pairs of its window: the kernels sum every pair
alone in one fixed order (the file says how). Where the kernels cannot be compiled, that is said once and the
Triton kernels serve. Which weights the engine gives them is `serves_experts` / `serves_linear` (EXPERT_KINDS,
LINEAR_KINDS).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KINDS = ("Q4_K", "Q8_0")
DECODE_TOKENS = 64  # the largest window the kernels take (each expert's pairs in tiles of TILE_PAIRS)
TILE_PAIRS = 8
# windows of at most this many tokens: a block a pair, no grouping launch (STRATA_CUDA_HELD_PER_PAIR for the
# tuner: a pair's bits are the same either way)
PER_PAIR_TOKENS = int(os.environ.get("STRATA_CUDA_HELD_PER_PAIR", "2"))
# Mirrors of native/held_experts.cu's constants: iterations in a warp's ring (its default; DEFINES may set
# another), bytes a warp's stage (an iteration of its 32 rows) takes, the stride of a row of the Q4_K scale
# table (floats), the most warps a block
STAGES = 2
STAGE_BYTES = 32 * 160
TABLE_STRIDE = 20
ITERATION_VALUES = {"Q4_K": 256, "Q8_0": 128}  # the values of k a warp's loop takes at a time
MAX_WARPS = 8
# Which held weights the engine gives these kernels (the rest go to the Triton kernels), and the most warps a
# block by kind, from `benchmarks/tune_held.py --warps 2 4 --variants ...` on an H100 (docs/PERFORMANCE.md,
# 2026-12-06): experts at 1 / 8 / 32 tokens, 4 warps, Q4_K 23.5 / 91.5 / 181 us a layer against the Triton
# kernels' 27.1 / 118 / 317, Q8_0 28.2 / 125 / 250 against 33.0 / 133 / 286 (2 warps a block are within 2%;
# 4 give a dense projection's few blocks more warps). Weights of WIDE_LINEAR rows or more (an LM head) go to
# these kernels for WIDE_KINDS alone (`tune_held.py --dense-only`, H100: Q4_K's LM head 83.6 / 95.2 / 264 us
# at 1 / 8 / 32 rows against Triton's 107 / 191 / 364; Q8_0's 120 / 123 / 345 against 123 / 138 / 238, so
# Triton keeps it). Read once, at import: for benchmarks, STRATA_CUDA_HELD_EXPERTS / STRATA_CUDA_HELD_LINEAR /
# STRATA_CUDA_HELD_WIDE (kinds, space-separated), STRATA_CUDA_HELD_WARPS ("Q4_K=4 Q8_0=8": the experts'; the
# down projection's STRATA_CUDA_HELD_DOWN_WARPS, the same unless given) and
# STRATA_CUDA_HELD_DEFINES override them (`benchmarks/pick_held.py` picks from the tuner's lines), and
# STRATA_CUDA_HELD=0 turns the kernels off.


def _kinds(variable: str, default: tuple[str, ...]) -> tuple[str, ...]:
    value = os.environ.get(variable)
    return default if value is None else tuple(value.split())


def _by_kind(variable: str, default: dict[str, int], cap: int) -> dict[str, int]:
    chosen = dict(word.split("=") for word in os.environ.get(variable, "").split())
    return {kind: min(cap, int(chosen.get(kind, value))) for kind, value in default.items()}


def _warps(variable: str, default: dict[str, int]) -> dict[str, int]:
    return _by_kind(variable, default, MAX_WARPS)


EXPERT_KINDS = _kinds("STRATA_CUDA_HELD_EXPERTS", ("Q4_K", "Q8_0"))
LINEAR_KINDS = _kinds("STRATA_CUDA_HELD_LINEAR", ("Q4_K", "Q8_0"))
WIDE_KINDS = _kinds("STRATA_CUDA_HELD_WIDE", ("Q4_K",))
BLOCK_WARPS = _warps("STRATA_CUDA_HELD_WARPS", {"Q4_K": 4, "Q8_0": 4})
DOWN_WARPS = _warps("STRATA_CUDA_HELD_DOWN_WARPS", BLOCK_WARPS)
# The dense projections' cap of their own (STRATA_CUDA_HELD_DENSE_WARPS): the tuner times the experts' warps
# alone, and a pick of 2 for experts left qkv and o, one wave of few blocks, half their warps (Q4_K decode at
# one row 653-676 tok/s against 776 with 4, docs/PERFORMANCE.md)
DENSE_WARPS = _warps("STRATA_CUDA_HELD_DENSE_WARPS", {"Q4_K": 4, "Q8_0": 4})
DISABLED = os.environ.get("STRATA_CUDA_HELD") == "0"
# Wider windows of at most this many tokens by kind (at most TILE_PAIRS: a token's picks are distinct
# experts, so an expert has at most that many pairs): a block an expert and column tile, each finding its
# expert's pairs in the routing itself, no grouping launch (the blocks of experts with no pair end at once);
# 0: the grouping launch's tiles. The same bits either way. Q8_0's experts at 8 tokens on an H100 took 106.8 /
# 107.5 us against 109.5 / 110.7 with the tiles (4 warps, without / with L2_PREFETCH=256), Q4_K's 95.7 / 91.6
# against 89.6 / 84.7 (`benchmarks/tune_held.py --per-expert 8`, docs/PERFORMANCE.md).
# STRATA_CUDA_HELD_PER_EXPERT ("Q4_K=8 Q8_0=0") overrides them.
PER_EXPERT_TOKENS = _by_kind("STRATA_CUDA_HELD_PER_EXPERT", {"Q4_K": 0, "Q8_0": TILE_PAIRS}, TILE_PAIRS)
# A dense projection of at most SPLIT_TILES column tiles (32 rows of the weight each) splits k over about
# SPLIT_WAVES blocks an SM (STRATA_CUDA_HELD_SPLIT_WAVES; 0: never), at most MAX_SPLITS and one iteration a
# warp; the split count follows the weight's shape and the device alone, so a row's bits stay those of any
# window. Off: on an H100 it made Q8_0's o faster at 1 and 8 rows and slower at 32, and lost summed over them
# (`benchmarks/tune_held.py --split-waves`, docs/PERFORMANCE.md).
SPLIT_WAVES = float(os.environ.get("STRATA_CUDA_HELD_SPLIT_WAVES", "0"))
SPLIT_TILES = 512
MAX_SPLITS = 8
# The source's compile-time choices (its #ifndef defaults where absent), e.g. "STAGES=3 MIN_BLOCKS=3",
# "Q8_HALF=0" (Q8_0's gate and up as bf16 operands, not the default fp16), "DOWN_HALF=0" (its down likewise,
# reading gate_up's output as bf16), "DENSE_STAGES=5" (a dense
# projection's ring: its first 4 iterations a warp copied before the kernel before it ends) or
# "DOWN_STAGES=4" (the experts' down projection's, copied before gate_up ends; both STAGES unless given, and
# slower when deeper on an H100) or "L2_PREFETCH=0" in STRATA_CUDA_HELD_DEFINES: `benchmarks/tune_held.py
# --variants` times several.
DEFINES = dict(word.split("=") for word in os.environ.get("STRATA_CUDA_HELD_DEFINES", "").split())
WIDE_LINEAR = 32768
GROUP_LIMIT = 1024  # `group_pairs` is one block of up to 1,024 threads: pairs and experts each at most this
MODE_TILES, MODE_PER_PAIR, MODE_DENSE, MODE_PER_EXPERT = 0, 1, 2, 3
HELD_KERNELS = tuple(
    f"held_{kind}_{role}" for kind in ("q4_k", "q8_0") for role in ("gate_up", "rows", "dense")
)
KERNELS = (*HELD_KERNELS, "group_pairs")
SOURCE_NAME = "held_experts.cu"
MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def ring(role: str) -> int:
    """Iterations in a warp's ring for a kernel of `role` ("gate_up", "down" or "dense"): the source's STAGES,
    DOWN_STAGES and DENSE_STAGES (each STAGES unless defined)."""
    stages = int(DEFINES.get("STAGES", STAGES))
    name = {"gate_up": "STAGES", "down": "DOWN_STAGES", "dense": "DENSE_STAGES"}[role]
    return int(DEFINES.get(name, stages))


def shared_bytes(kind: str, warps: int, role: str = "gate_up") -> int:
    """Dynamic shared memory of a block of `warps` warps of a kernel of `role` (native/held_experts.cu's
    layout): each warp's ring of stages (`ring`), its Q4_K scale table, and the partial sums the other warps
    hand to the first."""
    table = warps * 32 * TABLE_STRIDE * 4 if kind == "Q4_K" else 0
    return warps * ring(role) * STAGE_BYTES + table + (warps - 1) * 32 * 8 * 4


def _source() -> str:
    """The kernels' text: beside this module in a built package, else in the repository's native/."""
    here = Path(__file__).resolve()
    for path in (here.with_name(SOURCE_NAME), here.parents[2] / "native" / SOURCE_NAME):
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"{SOURCE_NAME} is neither beside {here.name} nor in native/")


def _compile(source: str, arch: str, nvrtc: ctypes.CDLL | None = None) -> bytes:
    """`source` compiled by NVRTC (`nvrtc`; by default the library the CUDA build of PyTorch brings) into
    machine code for `arch` (sm_90, ...); its log in the error if not."""
    if nvrtc is None:
        from torch.cuda._utils import _get_gpu_rtc_library

        nvrtc = _get_gpu_rtc_library()
    program = ctypes.c_void_p()

    def check(result: int, what: str) -> None:
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, text)
            raise RuntimeError(f"NVRTC {what} failed ({result}): {text.value.decode(errors='replace')}")

    check(
        nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), SOURCE_NAME.encode(), 0, None, None),
        "create",
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
        options += [f"-D{name}={value}".encode() for name, value in DEFINES.items()]
        check(
            nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options)),
            "compile",
        )
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "size")
        binary = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(program, binary), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return binary.raw


class _LaunchAttribute(ctypes.Structure):
    """The driver's CUlaunchAttribute: an id, then a 64-byte value (here an int)."""

    _fields_ = [
        ("id", ctypes.c_int),
        ("pad", ctypes.c_char * 4),
        ("value", ctypes.c_int),
        ("rest", ctypes.c_char * 60),
    ]


class _LaunchConfig(ctypes.Structure):
    """The driver's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("count", ctypes.c_uint),
    ]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Kernels:
    """The compiled kernels of one device, launched through the driver on the current stream: dependently
    where the device allows (`triton_launch.dependent_launch`; each kernel waits for the one before it before
    it reads what that one writes, native/held_experts.cu says what comes earlier)."""

    def __init__(self, device: torch.device) -> None:
        from torch.cuda._utils import _cuda_load_module, _get_gpu_runtime_library

        from app.kernels.triton_launch import dependent_launch

        major, minor = torch.cuda.get_device_capability(device)
        with torch.cuda.device(device):
            loaded = _cuda_load_module(_compile(_source(), f"sm_{major}{minor}"), list(KERNELS))
        self.functions = {name: loaded[name].func for name in KERNELS}
        self.driver = _get_gpu_runtime_library()
        self.dependent = (
            _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            if dependent_launch(device)
            else None
        )
        # a block's dynamic shared memory, at most: the device's limit less room for the static (a few words)
        properties = torch.cuda.get_device_properties(device)
        self.sms = properties.multi_processor_count
        # the split dense projections' arrival counters, one a column tile of a launch (back to 0 after each;
        # a device's windows run one after another on its stream)
        self.arrivals = torch.zeros(
            SPLIT_TILES * (DECODE_TOKENS // TILE_PAIRS), dtype=torch.int32, device=device
        )
        self.shared_limit = getattr(properties, "shared_memory_per_block_optin", 48 << 10) - 1024
        for name in HELD_KERNELS:  # their shared memory may pass the default 48 KB
            result = self.driver.cuFuncSetAttribute(
                self.functions[name], MAX_DYNAMIC_SHARED, self.shared_limit
            )
            if result != 0:
                raise RuntimeError(f"raising {name}'s shared memory failed (CUDA driver error {result})")

    def warps(self, kind: str, k: int, role: str) -> int:
        """Warps a block of a kernel of `role` ("gate_up": BLOCK_WARPS, "down": DOWN_WARPS, "dense":
        DENSE_WARPS) for rows of `k` values of `kind`: at least one iteration each (ITERATION_VALUES), at most
        MAX_WARPS, and what the device's shared memory holds with the role's ring. A function of the weight
        alone, so a row's sums are added in the same order in every window."""
        cap = {"gate_up": BLOCK_WARPS, "down": DOWN_WARPS, "dense": DENSE_WARPS}[role][kind]
        warps = max(1, min(cap, k // ITERATION_VALUES[kind]))
        while warps > 1 and shared_bytes(kind, warps, role) > self.shared_limit:
            warps -= 1
        return warps

    def splits(self, kind: str, k: int, n: int) -> int:
        """The blocks a dense projection into `n` columns over rows of `k` values of `kind` splits k over
        (SPLIT_WAVES): a function of the weight's shape and the device alone."""
        tiles, iterations = n // 32, k // ITERATION_VALUES[kind]
        if SPLIT_WAVES <= 0 or tiles > SPLIT_TILES:
            return 1
        return max(1, min(MAX_SPLITS, iterations, round(SPLIT_WAVES * self.sms / tiles)))

    def launch(self, name: str, grid: tuple[int, ...], threads: int, args: list, shared: int = 0) -> None:
        """Launch kernel `name` on `grid` (x, y[, z]) with `args` (tensors, None for a null pointer, or
        ctypes values) and `shared` bytes of dynamic shared memory."""
        values = [
            ctypes.c_void_p(arg.data_ptr() if isinstance(arg, torch.Tensor) else 0)
            if arg is None or isinstance(arg, torch.Tensor)
            else arg
            for arg in args
        ]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        x, y, z = (*grid, 1, 1)[:3]
        if self.dependent is None:
            result = self.driver.cuLaunchKernel(
                self.functions[name], x, y, z, threads, 1, 1, shared, stream, pointers, None
            )
        else:
            config = _LaunchConfig(
                (x, y, z), (threads, 1, 1), shared, stream, ctypes.pointer(self.dependent), 1
            )
            result = self.driver.cuLaunchKernelEx(ctypes.byref(config), self.functions[name], pointers, None)
        if result != 0:
            raise RuntimeError(f"launching {name} failed (CUDA driver error {result})")


@functools.cache
def _kernels(device: torch.device) -> _Kernels | None:
    try:
        return _Kernels(device)
    except Exception as error:  # no NVRTC, no CUDA headers, a driver too old: the Triton kernels serve
        log.warning("held-expert CUDA kernels unavailable (%s); the Triton kernels serve", error)
        return None


def serves_experts(kinds: tuple[str, str]) -> bool:
    """Whether the engine gives experts held as `kinds` (gate_up, down) to `expert_pairs`."""
    return kinds[0] in EXPERT_KINDS and kinds[1] in EXPERT_KINDS


def serves_linear(kind: str, n: int) -> bool:
    """Whether the engine gives a projection into `n` columns held as `kind` to `linear`."""
    return kind in LINEAR_KINDS and (n < WIDE_LINEAR or kind in WIDE_KINDS)


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)  # bf16 MMAs, cp.async


def enabled(device: torch.device) -> bool:
    """Whether the kernels serve on `device` (compiling them on first ask; never while a graph is captured,
    which a load would break: the engine's warm-up runs eagerly first)."""
    if device.type != "cuda" or DISABLED or not _capable(device):
        return False
    if torch.cuda.is_current_stream_capturing() and _kernels.cache_info().currsize == 0:
        return False
    return _kernels(device) is not None


def _fits(kind: str, weight: torch.Tensor, k: int, n: int, per_block: int) -> bool:
    """Whether the kernels tile `weight` [experts, rows, row bytes] of `kind` with reduction `k` into output
    columns `n` (`per_block` a block)."""
    return (
        kind in KINDS
        and k % ITERATION_VALUES[kind] == 0
        and n % per_block == 0
        and weight.stride(-1) == 1
        and weight.stride(1) % 16 == 0
        and weight.stride(0) % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def _rows_fit(x: torch.Tensor) -> bool:
    """Whether the kernels read activations `x` [rows, k] (bf16, 16-byte aligned rows)."""
    return x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def _matmul(
    kernels: _Kernels,
    kind: str,
    swiglu: bool,
    grid: tuple[int, int],
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int],
    scale: torch.Tensor | None,
    pairs: int,
    row_div: int,
    half_out: bool = False,
) -> None:
    """One launch of kind's kernel (`swiglu`: gate_up's, else rows'): out = x @ weight rows, per block's pairs
    as `routing` (ids, tile_expert, tile_pairs, mode) gives them; a dense projection's k split over
    `Kernels.splits` blocks. `half_out`: gate_up writes its output as a Q8_0 down built with DOWN_HALF reads
    it (`down_reads_half`)."""
    ids, tile_expert, tile_pairs, mode = routing
    k = x.shape[1]
    splits = kernels.splits(kind, k, weight.shape[1]) if mode == MODE_DENSE else 1
    share = k // ITERATION_VALUES[kind] // splits * ITERATION_VALUES[kind]  # a block's k, at least
    role = "gate_up" if swiglu else "dense" if mode == MODE_DENSE else "down"
    warps = kernels.warps(kind, share, role)
    split_sums = None
    if splits > 1:
        split_sums = torch.empty(grid[0] * grid[1] * splits * 256, dtype=torch.float32, device=x.device)
    kernels.launch(
        f"held_{kind.lower()}_{'rows' if role == 'down' else role}",
        (*grid, splits),
        warps * 32,
        [
            x,
            weight,
            out,
            ids,
            tile_expert,
            tile_pairs,
            scale,
            ctypes.c_int(mode),
            ctypes.c_int(pairs),
            ctypes.c_int(x.shape[1]),
            ctypes.c_int(weight.shape[1] // 2 if swiglu else 0),
            ctypes.c_longlong(weight.stride(0)),
            ctypes.c_longlong(weight.stride(1)),
            ctypes.c_longlong(x.stride(0)),
            ctypes.c_longlong(out.stride(0)),
            ctypes.c_int(row_div),
            split_sums,
            kernels.arrivals if splits > 1 else None,
            ctypes.c_int(half_out),
        ],
        shared_bytes(kind, warps, role),
    )


def expert_pairs(
    x: torch.Tensor,
    top_ids: torch.Tensor,
    top_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kinds: tuple[str, str],
) -> torch.Tensor | None:
    """Each (token, choice) pair's expert output times its routing weight, [tokens * top_k, hidden] bf16
    (rows of negative ids left unwritten), or None where these kernels do not apply. gate_up and down are
    held as GGUF blocks of `kinds`."""
    tokens, hidden = x.shape
    top_k = top_ids.shape[1]
    experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    pairs = tokens * top_k
    x = x.contiguous()
    if (
        tokens == 0
        or tokens > DECODE_TOKENS
        or not _rows_fit(x)
        or top_weights.dtype != torch.bfloat16
        or pairs > GROUP_LIMIT
        or experts > GROUP_LIMIT
        or not _fits(kinds[0], gate_up, hidden, intermediate, 16)
        or not _fits(kinds[1], down, intermediate, hidden, 32)
        or not enabled(x.device)
    ):
        return None
    kernels = _kernels(x.device)
    ids = top_ids.flatten().contiguous().long()
    scale = top_weights.flatten().contiguous()
    if tokens <= PER_PAIR_TOKENS:
        blocks, routing = pairs, (ids, None, None, MODE_PER_PAIR)
    elif tokens <= min(PER_EXPERT_TOKENS[kinds[0]], PER_EXPERT_TOKENS[kinds[1]]):
        blocks, routing = experts, (ids, None, None, MODE_PER_EXPERT)
    else:
        blocks = -(-pairs // TILE_PAIRS) + min(pairs, experts)
        tile_expert = torch.empty(blocks, dtype=torch.int32, device=x.device)
        tile_pairs = torch.empty(blocks * TILE_PAIRS, dtype=torch.int32, device=x.device)
        threads = min(GROUP_LIMIT, max(32, 1 << (max(pairs, experts) - 1).bit_length()))
        kernels.launch(
            "group_pairs",
            (1, 1),
            threads,
            [ids, ctypes.c_int(pairs), ctypes.c_int(experts), ctypes.c_int(blocks), tile_expert, tile_pairs],
        )
        routing = (None, tile_expert, tile_pairs, MODE_TILES)
    act = x.new_empty(pairs, intermediate)  # bf16, or fp16 of act / 64 (`down_reads_half`): 2 bytes a value
    y = x.new_empty(pairs, hidden)
    grid = (blocks, intermediate // 16)
    half = down_reads_half(kinds[1])
    _matmul(kernels, kinds[0], True, grid, x, gate_up, act, routing, None, pairs, top_k, half)
    grid = (blocks, hidden // 32)
    _matmul(kernels, kinds[1], False, grid, act, down, y, routing, scale, pairs, 1)
    return y


def down_reads_half(kind: str) -> bool:
    """Whether an experts' down projection held as `kind` takes its input as fp16 of act / 64 (Q8_0 unless
    built with DOWN_HALF=0: its codes as fp16 operands, one MMA a code where bf16 needs two), which its
    gate_up then writes."""
    return kind == "Q8_0" and DEFINES.get("DOWN_HALF", "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor | None:
    """x [rows, k] @ weight.T for a weight held as `kind` blocks [n, row bytes] (up to DECODE_TOKENS rows, in
    tiles of TILE_PAIRS: a row's bits the same in any window), or None where these kernels do not apply."""
    rows, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    stacked = weight.unsqueeze(0)
    if not 0 < rows <= DECODE_TOKENS or not _rows_fit(x) or not _fits(kind, stacked, k, n, 32):
        return None
    if not enabled(x.device):
        return None
    out = x.new_empty(rows, n)
    grid = (-(-rows // TILE_PAIRS), n // 32)
    _matmul(
        _kernels(x.device), kind, False, grid, x, stacked, out, (None, None, None, MODE_DENSE), None, rows, 1
    )
    return out
