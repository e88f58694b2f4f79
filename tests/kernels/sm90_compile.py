"""Compiles the held-weight kernels for an H100/H200 (sm_90) with no GPU, down to the binary (Triton's own
ptxas): `python tests/kernels/sm90_compile.py KIND [KIND ...]`, in a process without TRITON_INTERPRET (whose
kernels are not compiled at all). Prints each kernel's shared memory; exits non-zero on a compile error.
`blocks` as a KIND compiles the KV block-copy kernel (app/kernels/triton_blocks.py) for a bf16 and an 8-bit
block, and prints its 16-byte loads a thread; `q8_0-loads` compiles Q8_0's programs with pointers, strides and
k 16-byte aligned (as launches over rows of 256 values a multiple specialise them) and prints their global
loads by width and their warp shuffles (16-byte / 2-byte / shuffles): held Q8_0's codes load as 16-byte
vectors (or 16-byte asynchronous copies), only the scales two bytes at a time. `rowwise-registers` compiles
the i-quants' row sums at steps of k of 64, 128 and 256 and prints the registers a thread and the
bytes spilled that ptxas reports, with the warp shuffles a step. `routing` compiles a decode window's routing
in one launch and the norm that sums a MoE block's picks. `tier-wait` compiles the expert tier's added parts
waiting for the CPU pool's done word (app/kernels/triton_tier.py) and prints its volatile global loads and
its branches."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.kernels.triton_blocks import _copy_blocks_kernel
from app.kernels.triton_moe import HELD_CODES, _grouped_matmul, _held_rowwise
from app.kernels.triton_moe_block import _router_kernel
from app.kernels.triton_norm import _rms_norm_kernel
from app.kernels.triton_quant import ROWWISE_STEP_LIMITS, STEP_LIMITS
from app.kernels.triton_tier import _add_parts

POINTERS = {
    "x_ptr": "*bf16",
    "w_ptr": "*u8",
    "out_ptr": "*bf16",
    "rows_ptr": "*i32",
    "block_expert_ptr": "*i32",
    "scale_ptr": "*bf16",
    "table_ptr": "*fp32",
}
INTEGERS = ("pairs", "n", "k", "up_offset", "stride_xm", "stride_we", "stride_wn", "stride_om")


def _compiled(kernel: triton.JITFunction, constants: dict, num_warps: int, aligned: bool = False):
    """`kernel` with these constexprs compiled for sm_90 (`aligned`: pointers, strides and sizes known to
    be multiples of 16, as Triton specialises a launch's arguments)."""
    signature = {**POINTERS, **dict.fromkeys(INTEGERS, "i32"), **dict.fromkeys(constants, "constexpr")}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(signature)
        if aligned and (name in POINTERS or name in ("k", "stride_we", "stride_wn", "stride_xm", "stride_om"))
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": 3}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_sm_90(kernel: triton.JITFunction, constants: dict, num_warps: int) -> int:
    """Compile `kernel` with these constexprs for sm_90; returns its shared memory in bytes."""
    return _compiled(kernel, constants, num_warps).metadata.shared


def compile_held(kind: str) -> None:
    """A held type's tiles (16 rows, two steps' worth of its smallest step) and row sums (two rows)."""
    common = {"MODE": 1, "X_ROW_DIV": 1, "HELD": HELD_CODES[kind], "SWIGLU": True, "SCALE": False}
    common["PDL"] = True
    tiles = {
        "BLOCK_M": 16,
        "BLOCK_N": 64,
        "BLOCK_K": 2 * STEP_LIMITS[kind][0],
        "PRECISION": "tf32",
        "COLUMNS_FIRST": False,
    }
    rowwise = {"BLOCK_M": 2, "BLOCK_N": 4, "BLOCK_K": ROWWISE_STEP_LIMITS[kind][0]}
    shared = compile_for_sm_90(_grouped_matmul, common | tiles, num_warps=4)
    line = f"{kind} tiles {shared} rows {compile_for_sm_90(_held_rowwise, common | rowwise, num_warps=1)}"
    if kind == "Q8_0":  # its tiles may widen columns first (triton_moe.MoeTiles.columns_first)
        first = common | tiles | {"COLUMNS_FIRST": True, "BLOCK_K": 256}
        line += f" columns-first {compile_for_sm_90(_grouped_matmul, first, num_warps=4)}"
    print(line)


def compile_q8_0_loads() -> None:
    """Q8_0's row sums, tiles and columns-first tiles over aligned rows: their global loads by width."""
    common = {"MODE": 1, "X_ROW_DIV": 1, "HELD": HELD_CODES["Q8_0"], "SWIGLU": True, "SCALE": False}
    common["PDL"] = True
    tiles = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "PRECISION": "tf32", "COLUMNS_FIRST": False}
    forms = {
        "rows": (_held_rowwise, common | {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 256}, 1),
        "tiles": (_grouped_matmul, common | tiles, 4),
        "columns-first": (_grouped_matmul, common | tiles | {"COLUMNS_FIRST": True, "BLOCK_K": 256}, 4),
    }
    line = "q8_0-loads"
    for form, (kernel, constants, warps) in forms.items():
        ptx = _compiled(kernel, constants, warps, aligned=True).asm["ptx"]
        wide = ptx.count("ld.global.v4") + ptx.count("cp.async.cg.shared.global")
        narrow = ptx.count("ld.global.b16") + ptx.count("ld.global.u16")
        line += f" {form}:{wide}/{narrow}/{ptx.count('shfl.sync')}"
    print(line)


def compile_rowwise_registers() -> None:
    """The i-quants' row sums (1 x 4 columns, one warp, gate and up) at steps of 64, 128 and 256 values:
    registers a thread, bytes spilled, lane shuffles a step."""
    ptxas = get_ptxas(90).path
    for kind in ("IQ4_XS", "IQ3_XXS", "IQ3_S"):
        line = kind
        for step in (64, 128, 256):
            constants = {"MODE": 1, "X_ROW_DIV": 1, "HELD": HELD_CODES[kind], "SWIGLU": True, "SCALE": False}
            constants |= {"PDL": True, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": step}
            ptx = _compiled(_held_rowwise, constants, 1, aligned=True).asm["ptx"]
            with tempfile.TemporaryDirectory() as folder:
                source = Path(folder) / "kernel.ptx"
                source.write_text(ptx)
                command = [ptxas, "-v", "--gpu-name=sm_90a", str(source), "-o", str(Path(folder) / "out")]
                report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
            registers = re.search(r"Used (\d+) registers", report)
            spilled = re.search(r"(\d+) bytes spill stores", report)
            assert registers is not None and spilled is not None, report
            line += f" {step}:{registers.group(1)}/{spilled.group(1)}/{ptx.count('shfl.sync')}"
        print(line)


def compile_blocks() -> None:
    """The block-copy kernel for q30's bf16 blocks (4,096 words) and 8-bit ones (2,304), pointers aligned."""
    pointers = ("src_k", "src_v", "dst_k", "dst_v", "src_ids", "dst_ids")
    signature = {**dict.fromkeys(pointers, "*i32"), "pairs": "i32", "grid": "i32"}
    signature |= {"WORDS": "constexpr", "CHUNK": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    line = "blocks"
    for words in (4096, 2304):
        constants = {"WORDS": words, "CHUNK": triton.next_power_of_2(words)}
        source = ASTSource(fn=_copy_blocks_kernel, signature=signature, constexprs=constants, attrs=aligned)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        line += f" {words}:{ptx.count('ld.global.v4')}"
    print(line)


def compile_routing() -> None:
    """A decode window's routing in one launch (`_router_kernel`, with and without the shared expert's
    program) and the norm that sums a block's picks (`_rms_norm_kernel` with PICKS), at Qwen3-30B-A3B's
    sizes in bf16: each kernel's shared memory."""
    router = {"x_ptr": "*bf16", "router_ptr": "*bf16", "shared_router_ptr": "*bf16", "logits_ptr": "*bf16"}
    router |= {"ids_ptr": "*i64", "weights_ptr": "*bf16", "counts_ptr": "*i64", "live_ptr": "*i64"}
    router |= {"arrivals_ptr": "*i32", "experts": "i32", "stride_x": "i32", "stride_router": "i32"}
    router |= {"stride_logits": "i32"}
    norm = {"x_ptr": "*bf16", "ids_ptr": "*i64", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}
    norm |= {"res_out_ptr": "*bf16", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32"}
    norm |= {"stride_ro": "i32", "eps": "fp32"}
    forms = []
    for shared in (False, True):
        constants = {"K": 2048, "BLOCK_N": 2, "BLOCK_K": 2048, "BLOCK_E": 128, "TOP_K": 8, "BLOCK_TOP": 8}
        constants |= {"RENORM": True, "HAS_LIVE": True, "HAS_SHARED": shared, "PDL": True}
        forms.append((f"router-shared-{int(shared)}", _router_kernel, router, constants))
    constants = {"DIM": 2048, "BLOCK": 2048, "OFFSET": False, "ADD_RESIDUAL": True, "PICKS": 8, "PDL": True}
    forms.append(("norm-picks", _rms_norm_kernel, norm, constants))
    line = "routing"
    for name, kernel, pointers, constants in forms:
        signature = {**pointers, **dict.fromkeys(constants, "constexpr")}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        line += f" {name}:{compiled.metadata.shared}"
    print(line)


def compile_tier_wait() -> None:
    """`_add_parts` of bf16 rows with STAGED and WAIT: the volatile global loads (the done word's, before and
    in the loop, and the sums') and the branches of its PTX."""
    pointers = {"resident_ptr": "*bf16", "staged_ptr": "*bf16", "sums_ptr": "*fp32", "done_ptr": "*i32"}
    pointers |= {"out_ptr": "*bf16", "hidden": "i32"}
    constants = {"STAGED": True, "WAIT": True, "BLOCK": 1024, "PDL": True}
    signature = {**pointers, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=_add_parts, signature=signature, constexprs=constants)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print(f"tier-wait {ptx.count('ld.volatile.global')} {ptx.count('bra')}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        if name == "blocks":
            compile_blocks()
        elif name == "routing":
            compile_routing()
        elif name == "tier-wait":
            compile_tier_wait()
        elif name == "q8_0-loads":
            compile_q8_0_loads()
        elif name == "rowwise-registers":
            compile_rowwise_registers()
        else:
            compile_held(name)
