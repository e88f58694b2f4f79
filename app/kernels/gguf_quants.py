"""GGUF quant types dequantized in torch: the reference the quantized kernels are held to.

Each function takes the raw bytes of whole blocks, [blocks, block bytes] uint8, and returns their values
[blocks, values per block] float32, laid out as llama.cpp stores them (ggml's block structs, little-endian).
The lookup tables of the i-quants (their grids, the sign patterns, IQ4's non-linear levels) are read from the
`gguf` package, which carries llama.cpp's. `dequantize` dispatches on the type's name.

Kernels read a weight's blocks in place as the file holds them, except Q8_0's, which are held reordered
(`to_held`, the same bytes): a row's int8 codes first, all of them, then its blocks' fp16 scales, so a row's
codes lie as one run, 16-byte aligned where the row's values are a multiple of 256 (a block of the file's
layout puts its codes two bytes past its scale, so they could only be read two bytes at a time).
"""

from __future__ import annotations

import functools

import torch

QK_K = 256  # values per super-block of the K- and i-quants


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _u32(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 words of raw [blocks, 4 * words] as int64 [blocks, words]."""
    b = raw.reshape(raw.shape[0], -1, 4).long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: a float16 scale, then 32 int8."""
    return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def _scales_mins_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block from its 12 packed bytes."""
    q = packed.long()
    low = q[:, 0:4] & 63, q[:, 4:8] & 63
    high_scale = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    high_min = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return torch.cat((low[0], high_scale), 1).float(), torch.cat((low[1], high_min), 1).float()


def _nibbles(qs: torch.Tensor, width: int = 32) -> torch.Tensor:
    """Bytes [blocks, width * n] -> 4-bit values [blocks, 2 * width * n]: per `width` bytes, their low nibbles
    then their high ones."""
    q = qs.long().reshape(qs.shape[0], -1, 1, width)
    return torch.cat((q & 0xF, q >> 4), 2).reshape(qs.shape[0], -1)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of 4-bit q."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _scales_mins_k4(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144]).float().reshape(-1, 8, 32)
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(-1, QK_K)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: as Q4_K, with a fifth bit of each value in 32 bytes (bit g of byte l: value l of group g)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _scales_mins_k4(blocks[:, 4:16])
    high = blocks[:, 16:48].long()
    bits = torch.stack([(high >> g) & 1 for g in range(8)], 1)  # [blocks, group, 32]
    q = (_nibbles(blocks[:, 48:176]).reshape(-1, 8, 32) + 16 * bits).float()
    return ((d * scales)[..., None] * q - (dmin * mins)[..., None]).reshape(-1, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (groups of 16), d."""
    low, high = blocks[:, 0:128].long(), blocks[:, 128:192].long()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(blocks, 208)
    values = []
    for half in range(2):  # each half: 128 values from 64 low bytes and 32 high bytes
        ql, qh = low[:, 64 * half : 64 * half + 64], high[:, 32 * half : 32 * half + 32]
        values += [
            (ql[:, :32] & 0xF) | ((qh & 3) << 4),
            (ql[:, 32:] & 0xF) | (((qh >> 2) & 3) << 4),
            (ql[:, :32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[:, 32:] >> 4) | (((qh >> 6) & 3) << 4),
        ]
    q = (torch.stack(values, 1) - 32).float().reshape(-1, 16, 16)
    return (d[..., None] * scales[..., None] * q).reshape(-1, QK_K)


@functools.cache
def i_quant_tables() -> dict[str, torch.Tensor]:
    """llama.cpp's i-quant tables, from the gguf package: grids, sign bytes, IQ4's levels."""
    from gguf import quants

    tables = {}
    for name in ("IQ3_XXS", "IQ3_S"):
        kind = getattr(quants, name)
        kind.init_grid()
        tables[name] = torch.from_numpy(kind.grid.reshape(-1, 4).astype("float32"))
    tables["signs"] = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8).long()
    tables["iq4"] = torch.tensor(quants.IQ4_NL.kvalues, dtype=torch.float32)
    return tables


def _signs(bytes_: torch.Tensor) -> torch.Tensor:
    """Sign bytes [..., n] -> +-1 [..., n, 8] (bit j set: value j is negative)."""
    bits = (bytes_[..., None] >> torch.arange(8, device=bytes_.device)) & 1
    return 1.0 - 2.0 * bits.float()


def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: d, 16 high bits and 4 bytes of low bits of 8 six-bit scales, 128 bytes of 4-bit level ids."""
    d = _f16(blocks, 0)
    high = blocks[:, 2].long() | (blocks[:, 3].long() << 8)
    low = blocks[:, 4:8].long()
    group = torch.arange(8, device=blocks.device)
    scale = ((low[:, group // 2] >> (4 * (group % 2))) & 0xF) | (((high[:, None] >> (2 * group)) & 3) << 4)
    levels = i_quant_tables()["iq4"].to(blocks.device)[_nibbles(blocks[:, 8:136], 16).reshape(-1, 8, 32)]
    return ((d * (scale - 32).float())[..., None] * levels).reshape(-1, QK_K)


def iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """IQ3_XXS: d, 64 grid ids (4 values each), then per group of 32 a word: four 7-bit sign ids and a 4-bit
    scale."""
    tables = {name: table.to(blocks.device) for name, table in i_quant_tables().items()}
    d = _f16(blocks, 0)
    grid = tables["IQ3_XXS"][blocks[:, 2:66].long()].reshape(-1, 8, 4, 8)  # [blocks, group, 4 x 8 values]
    words = _u32(blocks[:, 66:98])  # [blocks, group]
    scale = d * (0.5 + (words >> 28).float()) * 0.5
    sign_ids = (words[..., None] >> (7 * torch.arange(4, device=blocks.device))) & 127
    signs = _signs(tables["signs"][sign_ids])  # [blocks, group, 4, 8]
    return (scale[..., None, None] * grid * signs).reshape(-1, QK_K)


def iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """IQ3_S: d, 64 low bytes of 9-bit grid ids (their ninth bits in 8 bytes), 32 sign bytes, 4 bytes of
    4-bit scales (odd ones: 1 + 2 * scale)."""
    tables = {name: table.to(blocks.device) for name, table in i_quant_tables().items()}
    d = _f16(blocks, 0)
    low = blocks[:, 2:66].long()
    high = blocks[:, 66:74].long()
    bits = torch.arange(8, device=blocks.device)
    ninth = ((high[:, :, None] >> bits) & 1).reshape(-1, 64)  # bit i of high byte g: id 8g + i
    grid = tables["IQ3_S"][low | (ninth << 8)].reshape(-1, 8, 4, 8)
    signs = _signs(blocks[:, 74:106].long()).reshape(-1, 8, 4, 8)
    packed = blocks[:, 106:110].long()
    scale = torch.stack((packed & 0xF, packed >> 4), 2).reshape(-1, 8)
    return ((d * (1 + 2 * scale).float())[..., None, None] * grid * signs).reshape(-1, QK_K)


I_QUANTS = ("IQ4_XS", "IQ3_XXS", "IQ3_S")  # the types whose values come from lookup tables (`i_quant_tables`)

DEQUANTIZE = {
    "Q8_0": (32, 34, q8_0),
    "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k),
    "Q6_K": (QK_K, 210, q6_k),
    "IQ4_XS": (QK_K, 136, iq4_xs),
    "IQ3_XXS": (QK_K, 98, iq3_xxs),
    "IQ3_S": (QK_K, 110, iq3_s),
}  # type name -> (values per block, bytes per block, dequantizer)


def random_blocks(
    kind: str, shape: tuple[int, ...], seed: int = 0, scale: float = 0.05, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Random whole blocks of `kind` (any type of DEQUANTIZE) for a weight of `shape` [..., columns], as uint8
    [..., columns / values * bytes]: random quants under finite scales, values within about +-`scale` and
    centred near 0 (random-weight models for tests and benchmarks)."""
    values, size, _ = DEQUANTIZE[kind]
    *rows, columns = shape
    if columns % values:
        raise ValueError(f"{kind} rows hold whole blocks of {values} weights, not {columns}")
    g = torch.Generator(device=device).manual_seed(seed)
    count = (*rows, columns // values)
    blocks = torch.randint(0, 256, (*count, size), dtype=torch.uint8, generator=g, device=device)
    jitter = torch.rand(count, generator=g, device=device) + 0.5
    if kind == "Q8_0":
        blocks[..., 0:2] = (jitter * scale / 127).half().unsqueeze(-1).view(torch.uint8)
    elif kind == "Q4_K":  # value = d * scale * q - dmin * min: scales and mins up to 63, q up to 15
        d = jitter * scale / (32 * 8)
        blocks[..., 0:2] = d.half().unsqueeze(-1).view(torch.uint8)
        blocks[..., 2:4] = (d * 7.5).half().unsqueeze(-1).view(torch.uint8)
    elif kind == "Q5_K":  # as Q4_K with q up to 31
        d = jitter * scale / (32 * 16)
        blocks[..., 0:2] = d.half().unsqueeze(-1).view(torch.uint8)
        blocks[..., 2:4] = (d * 15.5).half().unsqueeze(-1).view(torch.uint8)
    elif kind == "Q6_K":  # value = d * scale * (q - 32): int8 scales, q up to 63
        blocks[..., 208:210] = (jitter * scale / 2048).half().unsqueeze(-1).view(torch.uint8)
    elif kind in (
        "IQ4_XS",
        "IQ3_XXS",
        "IQ3_S",
    ):  # d * (scale - 32) * level up to 127; d * ~4 * grid up to 62;
        # d * (1 + 2 * scale) * grid up to 15
        d = jitter * scale / {"IQ4_XS": 1024, "IQ3_XXS": 128, "IQ3_S": 128}[kind]
        blocks[..., 0:2] = d.half().unsqueeze(-1).view(torch.uint8)
    else:
        raise ValueError(f"no random blocks of {kind}")
    return blocks.reshape(*rows, -1)


def dequantize(kind: str, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of `shape` held by `raw` (uint8, whole blocks of quant type `kind` as the file
    lays them out)."""
    _, size, function = DEQUANTIZE[kind]
    return function(raw.reshape(-1, size)).reshape(shape)


def to_held(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """A weight's blocks [..., row bytes] as the file lays them out, in the layout kernels hold them in:
    Q8_0's rows as all their int8 codes, then all their fp16 scales (a new tensor); others as they are."""
    if kind != "Q8_0":
        return blocks
    count = blocks.shape[-1] // 34
    laid = blocks.reshape(-1, count, 34)
    held = torch.empty(laid.shape[0], 34 * count, dtype=torch.uint8, device=blocks.device)
    held[:, : 32 * count].view(-1, count, 32).copy_(laid[:, :, 2:])
    held[:, 32 * count :].view(-1, count, 2).copy_(laid[:, :, :2])
    return held.reshape(blocks.shape)


def from_held(kind: str, held: torch.Tensor) -> torch.Tensor:
    """The file's layout of held blocks (`to_held` undone)."""
    if kind != "Q8_0":
        return held
    count = held.shape[-1] // 34
    rows = held.reshape(-1, 34 * count)
    laid = torch.empty(rows.shape[0], count, 34, dtype=torch.uint8, device=held.device)
    laid[:, :, 2:] = rows[:, : 32 * count].view(-1, count, 32)
    laid[:, :, :2] = rows[:, 32 * count :].view(-1, count, 2)
    return laid.reshape(held.shape)


def dequantize_held(kind: str, held: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of `shape` held by `held` (a held weight's blocks, `to_held`'s layout)."""
    return dequantize(kind, from_held(kind, held), shape)
