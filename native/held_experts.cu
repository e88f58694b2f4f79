// Routed experts and dense projections held as GGUF blocks (Q4_K, Q8_0) for windows of up to 64 tokens, on
// the tensor cores.
//
// Compiled at first use by NVRTC (app/kernels/cuda_held.py); no header is included, so the same text also
// builds with `nvcc -arch=sm_90 -cubin`.
//
// A block computes 32 output columns of one expert for up to 8 (token, expert) pairs: 16 gate rows and the 16
// matching up rows (gate_up, SwiGLU applied), or 32 rows (down, dense). Its warps (blockDim.x / 32, which the
// caller sets from k alone) each take a contiguous share of k and add their sums in a fixed order at the end,
// so a pair's result depends on its expert's weights and its own activations only, never on the other pairs
// of its window or on their number. A dense projection of few column tiles may also split k over gridDim.z
// blocks (a count the caller sets from the weight's shape alone), added in split order by the last to finish
// (`split_total`).
//
// Each warp runs m16n8k16 bf16 MMAs with the weights as the 16-row left operand and the pairs' activations
// as the 8-column right one. A thread widens the codes it loaded straight into its fragment registers: a
// 4-bit code q ORed into the mantissa of bf16 128.0 is exactly 128 + q (one LOP3 for two codes). Q8_0's
// byte b (offset to b + 128 = 16 h + l: the byte's top bit flipped, folded into the high nibble's widening)
// goes in as two operands, 128 + l and 2048 + 16 h, summed by the same accumulator. The k order inside an MMA is free as long as both operands agree, so a quad of threads
// covers a 32-byte run of codes, 8 bytes a thread, and the activations are permuted to match.
// Every 32 codes (a scale group) the MMA's sums are scaled in fp32; the offsets (128, 2304) and Q4_K's
// group minimum are taken off with the group's activation sums, which one more MMA against a fragment of
// ones gives. The codes' products are exact and summed in fp32. Q8_0's gate and up take fp16 operands
// instead (Q8_HALF, on unless built with Q8_HALF=0), a whole code an operand (`group_mma_half`), and so does
// down (DOWN_HALF), whose input, which may leave fp16's range, gate_up writes as fp16 of act / ACT_SCALE.
//
// A warp's loop takes an iteration of its 32 rows at a time: Q4_K a super-block (144 bytes a row: head and 256
// codes), Q8_0 four blocks (128 codes and their 4 scales). Its lanes copy the iteration, runs of whole rows,
// into a ring of STAGES iterations in shared memory with cp.async, STAGES - 1 iterations ahead of the one
// the warp computes; the MMAs then take it in units of 32 bytes of codes a row (Q4_K: a
// 64-value stretch, two groups; Q8_0: one group of 32). Q4_K's scales are decoded once a super-block: each
// lane decodes its row's 8 groups into a table of the warp that all lanes read.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define TILE_PAIRS 8
#ifndef STAGES
#define STAGES 2  // iterations in a warp's ring (the copies run STAGES - 1 iterations ahead)
#endif
#ifndef DOWN_STAGES
#define DOWN_STAGES STAGES  // the ring of the experts' down projection's warp, whose first DOWN_STAGES - 1
#endif                      // iterations are copied before gate_up has ended
#ifndef DENSE_STAGES
#define DENSE_STAGES STAGES  // the ring of a dense projection's warp, whose first DENSE_STAGES - 1 iterations
#endif                       // are copied before the kernel before it has ended
#define UNITS 4   // units an iteration
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // blocks of MAX_WARPS threads an SM must hold: caps a thread's registers
#endif
#ifndef Q8_HALF
#define Q8_HALF 1  // Q8_0's gate and up as fp16 operands, a byte's code in one MMA (see compute_unit); 0: bf16
#endif
#ifndef DOWN_HALF
#define DOWN_HALF 1  // Q8_0's down as fp16 operands, its input written by gate_up as fp16 (see ACT_SCALE); 0: bf16
#endif
// With DOWN_HALF gate_up hands Q8_0's down its SwiGLU output as fp16 of act / ACT_SCALE, rounded once from
// fp32 (11 bits where bf16 keeps 8): exact to fp16's precision for |act| in [2^-8, 2^22), within 2^-19 of it
// below, held at the largest finite fp16 (act 2^22) beyond; down's sums are scaled back by ACT_SCALE.
#define ACT_SCALE 64.f
#define MAX_WARPS 8
#define KIND_Q8_0 1
#define KIND_Q4_K 2
#define MODE_TILES 0       // block x: a tile of `group_pairs` (tile_expert, tile_pairs)
#define MODE_PER_PAIR 1    // block x: pair x alone, its expert ids[x] (int64)
#define MODE_DENSE 2       // block x: rows 8 x ... of a dense matmul (expert 0)
#define MODE_PER_EXPERT 3  // block x: expert x's pairs in ids (int64), found by the block (at most TILE_PAIRS)
#define TABLE_STRIDE 20  // floats a row of a warp's Q4_K scale table (16 used; 20 keeps its reads apart in banks)
// Shared memory of a block of W warps (app/kernels/cuda_held.py computes the same): W * RING * STAGE_BYTES (RING:
// gate_up's STAGES, down's DOWN_STAGES, a dense projection's DENSE_STAGES),
// then (Q4_K) W tables of 32 rows of TABLE_STRIDE floats, then (W - 1) * 32 * 8 floats of partial sums.

// A stage of a warp in shared memory: an iteration of its 32 rows (row j: block j / 16's row j % 16), ROW_BYTES
// apart, as they lie in the weight (Q4_K: head, then codes; Q8_0: codes, then the 4 fp16 scales). 160 bytes
// keep a quad's reads of 8 rows apart in banks. The activations, which every block reads, come through the L1
// cache.
#define ROW_BYTES 160
#define STAGE_BYTES (32 * ROW_BYTES)
// An iteration of a warp's loop: UNITS units, Q4_K a super-block (144 bytes of 256 values), Q8_0 four blocks
// (128 bytes of codes, their fp16 scales at the row's end)
#define ITERATION_BYTES(KIND) ((KIND) == KIND_Q4_K ? 144 : 128)
#define ITERATION_VALUES(KIND) ((KIND) == KIND_Q4_K ? 256 : 128)

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// f as fp16, rounded to nearest; beyond fp16's range the largest finite fp16 of its sign (NaN stays NaN).
__device__ __forceinline__ u16 f32_to_f16_finite(float f) {
    u16 h;
    asm("cvt.rn.satfinite.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Programmatic dependent launch (sm_90 on; no-ops where the kernel was launched without it, as on older
// GPUs): wait until the kernel before this one on the stream has ended with its writes visible, and let the
// kernel after this one have its blocks placed (each of them waits in turn before reading what this one
// writes).
__device__ __forceinline__ void previous_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void next_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The weights' copies: through the L1 cache (COPY_L1 1, "ca") or past it (0, "cg": 16-byte copies alone), and
// with L2_PREFETCH 128 or 256 (0: none) the L2 asked to fetch the whole aligned run of that many bytes around
// each copy, so a row's next bytes are on their way before the warp's ring asks for them. 256 on an H100:
// Q4_K's experts at 8 tokens 84.7 us against 89.6 (4 warps), Q4_K's LM head at 8 rows 89.1 against 94.8,
// the rest within 1.5% (docs/PERFORMANCE.md).
#ifndef COPY_L1
#define COPY_L1 1
#endif
#ifndef L2_PREFETCH
#define L2_PREFETCH 256
#endif
#if L2_PREFETCH == 256
#define PREFETCH_SIZE ".L2::256B"
#elif L2_PREFETCH == 128
#define PREFETCH_SIZE ".L2::128B"
#else
#define PREFETCH_SIZE ""
#endif
#if COPY_L1
#define COPY16_LEVEL "ca"
#else
#define COPY16_LEVEL "cg"
#endif

__device__ __forceinline__ void copy8(u8* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global" PREFETCH_SIZE " [%0], [%1], 8;\n" ::"r"(shared_address(dst)), "l"(src)
                 : "memory");
}

__device__ __forceinline__ void copy16(u8* dst, const void* src) {
    asm volatile("cp.async." COPY16_LEVEL ".shared.global" PREFETCH_SIZE " [%0], [%1], 16;\n" ::"r"(
                     shared_address(dst)),
                 "l"(src)
                 : "memory");
}

__device__ __forceinline__ void copies_sent() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait for all but the RING - 1 newest groups of copies.
template <int RING>
__device__ __forceinline__ void copies_done_but_newest() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(RING - 1) : "memory");
}

// c += A B, an m16n8k16 MMA with fp32 accumulators, of bf16 operands (fp16 where HALF).
#define MMA_OF(TYPE)                                                                                      \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
                 "{%8,%9}, {%0,%1,%2,%3};\n"                                                              \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool HALF = false>
__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (HALF) {
        MMA_OF("f16");
    } else {
        MMA_OF("bf16");
    }
}

// Two bf16 (a word, the first in its low half) as two fp16, rounded to nearest: exact within fp16's normal
// range, which a normed hidden state keeps to.
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v) {
    u32 h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(__uint_as_float(v & 0xFFFF0000u)), "f"(__uint_as_float(v << 16)));
    return h;
}

// (a & b) ^ c in one LOP3 (the compiler splits it when b and c are both immediates).
__device__ __forceinline__ u32 and_xor(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Codes at bits `shift` and `shift` + 16 of w, as two bf16 (`magic` ^ code): `magic` + code where its low
// nibbles are 0, and Q8_0's high nibbles' sign flip folded in where they are 8.
__device__ __forceinline__ u32 widen(u32 w, int shift, u32 magic) { return and_xor(w >> shift, 0x000F000Fu, magic); }

// One 32-code group's MMAs for both halves h of a quad's 8-byte pieces: c += A(codes) B(x) for each of the
// two weight blocks, where the fragments' k order is byte 4h + {0, 2} (low slots), 4h + {1, 3} (high slots).
// `nibble` selects the code's nibble (0: low, 4: high) and `magic` its bf16 exponent; `words[b][r][h]` are
// block b's row (g, g + 8)'s words.
__device__ __forceinline__ void group_mma(
    float (&c)[2][4], const u32 (&words)[2][2][2], const u32 (&xb)[2][2], int nibble, u32 magic) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            mma(c[b], widen(words[b][0][h], nibble, magic), widen(words[b][1][h], nibble, magic),
                widen(words[b][0][h], nibble + 8, magic), widen(words[b][1][h], nibble + 8, magic), xb[h][0],
                xb[h][1]);
        }
    }
}

// The right-operand fragments of 8 activations x0..x7 (4 words) for the two halves: (x0, x2), (x1, x3) and
// (x4, x6), (x5, x7).
__device__ __forceinline__ void x_fragments(const uint4 v, u32 (&xb)[2][2]) {
    xb[0][0] = __byte_perm(v.x, v.y, 0x5410);
    xb[0][1] = __byte_perm(v.x, v.y, 0x7632);
    xb[1][0] = __byte_perm(v.z, v.w, 0x5410);
    xb[1][1] = __byte_perm(v.z, v.w, 0x7632);
}

// Sum over the group's 32 activations of each pair (column), by MMAs against ones.
__device__ __forceinline__ void group_sums(float (&s)[4], const u32 (&xb)[2][2]) {
    const u32 one = 0x3F803F80u;
    s[0] = s[1] = s[2] = s[3] = 0.f;
    mma(s, one, one, one, one, xb[0][0], xb[0][1]);
    mma(s, one, one, one, one, xb[1][0], xb[1][1]);
}

// acc[b][i] += D * c - E * s for the rows (g: i < 2, g + 8: i >= 2) of block b.
__device__ __forceinline__ void scale_into(
    float (&acc)[2][4], const float (&c)[2][4], const float (&s)[4], const float (&d)[2][2],
    const float (&e)[2][2]) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[b][i] = fmaf(d[b][i >> 1], c[b][i], fmaf(-e[b][i >> 1], s[i], acc[b][i]));
        }
    }
}

// 8 activations of a pair's row from k (zeros for an empty slot), through the L1 cache.
__device__ __forceinline__ uint4 load_x(const u16* row, int k) {
    uint4 v;
    v.x = v.y = v.z = v.w = 0u;
    if (row) v = *reinterpret_cast<const uint4*>(row + k);
    return v;
}

// Q4_K: one row's super-block head (d, dmin, 12 bytes of 6-bit scales and mins) decoded into its table row:
// for group j, D = d * scale at [2 j] and E = 128 D + dmin * min at [2 j + 1].
__device__ __forceinline__ void decode_head(const uint4 head, float* row) {
    const float d = f16_to_f32((u16)(head.x & 0xFFFF)), dmin = f16_to_f32((u16)(head.x >> 16));
    const u32 scales[2] = {head.y & 0x3F3F3F3Fu, (head.w & 0x0F0F0F0Fu) | (((head.y >> 6) & 0x03030303u) << 4)};
    const u32 mins[2] = {head.z & 0x3F3F3F3Fu, ((head.w >> 4) & 0x0F0F0F0Fu) | (((head.z >> 6) & 0x03030303u) << 4)};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float4 v;
        const int j0 = 2 * q, j1 = 2 * q + 1;
        v.x = d * (float)((scales[j0 >> 2] >> (8 * (j0 & 3))) & 0xFF);
        v.y = fmaf(dmin, (float)((mins[j0 >> 2] >> (8 * (j0 & 3))) & 0xFF), 128.f * v.x);
        v.z = d * (float)((scales[j1 >> 2] >> (8 * (j1 & 3))) & 0xFF);
        v.w = fmaf(dmin, (float)((mins[j1 >> 2] >> (8 * (j1 & 3))) & 0xFF), 128.f * v.z);
        reinterpret_cast<float4*>(row)[q] = v;
    }
}

// The copies of iteration `it` of the warp's 32 rows into `stage`, 8 lanes a row and 4 rows a pass (each
// pass's reads whole runs of the rows): lane L copies 16-byte piece L % 8 of row 4 p + L / 8 in pass p, and
// the lane of piece 0 its row's remainder (Q4_K: the super-block's last 16 bytes; Q8_0: the 4 scales).
// `rows[b]`: the start of the lane's first row of block b (row L / 8 of it); `four_rows`: 4 rows' bytes.
template <int KIND>
__device__ __forceinline__ void copy_iteration(
    u8* stage, const u8* const (&rows)[2], i64 four_rows, int it, int k) {
    const int lane = threadIdx.x & 31, piece = lane & 7;
#pragma unroll
    for (int pass = 0; pass < 8; ++pass) {
        const u8* row = rows[pass >> 2] + (pass & 3) * four_rows;
        const u8* from = row + (i64)it * ITERATION_BYTES(KIND);
        u8* to = stage + (4 * pass + (lane >> 3)) * ROW_BYTES;
        copy16(to + 16 * piece, from + 16 * piece);
        if (piece == 0) {
            if (KIND == KIND_Q4_K) {
                copy16(to + 128, from + 128);
            } else {
                copy8(to + 128, row + k + 8 * it);
            }
        }
    }
}

// Q8_0's 32-code group as fp16 operands (HALF): a code byte with its top bit flipped, b = q + 128, placed
// under fp16 1024's exponent byte (one PRMT for two codes) is exactly 1152 + q, and each weight block's two
// halves take one MMA each against the activations as fp16 (converted from bf16, or as given where X16; the
// group's sums likewise), where the bf16 operands need two (a nibble a code). The k order is the bf16 path's:
// bytes 4h + {0, 2} against activations 4h + {0, 2}, bytes 4h + {1, 3} against 4h + {1, 3}.
template <bool X16>
__device__ __forceinline__ void group_mma_half(
    float (&c)[2][4], float (&s)[4], const u32 (&words)[2][2][2], const u32 (&xb)[2][2]) {
    const u32 one = 0x3C003C00u, exponent = 0x64646464u;
    u32 xh[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        xh[h][0] = X16 ? xb[h][0] : bf16x2_to_f16x2(xb[h][0]);
        xh[h][1] = X16 ? xb[h][1] : bf16x2_to_f16x2(xb[h][1]);
    }
    s[0] = s[1] = s[2] = s[3] = 0.f;
    mma<true>(s, one, one, one, one, xh[0][0], xh[0][1]);
    mma<true>(s, one, one, one, one, xh[1][0], xh[1][1]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const u32 g_row = words[b][0][h] ^ 0x80808080u, g8_row = words[b][1][h] ^ 0x80808080u;
            mma<true>(c[b], __byte_perm(g_row, exponent, 0x4240), __byte_perm(g8_row, exponent, 0x4240),
                    __byte_perm(g_row, exponent, 0x4341), __byte_perm(g8_row, exponent, 0x4341), xh[h][0],
                    xh[h][1]);
        }
    }
}

// Unit S's MMAs from `stage` and the pair's activations `x` (Q4_K: the unit's two groups'), scaled into acc.
// Q4_K: its scales from the warp's table, decoded at unit 0 from the super-block's heads. HALF: Q8_0's codes
// as fp16 operands (`group_mma_half`), against activations given as fp16 where X16.
template <int KIND, int S, bool HALF, bool X16>
__device__ __forceinline__ void compute_unit(
    const u8* stage, float* table, const uint4 (&x)[2], float (&acc)[2][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u32 words[2][2][2];
    float d[2][2], e[2][2];
    u32 xb[2][2];
    float s[4];
    float c[2][4] = {};
    constexpr int codes_at = KIND == KIND_Q4_K ? 16 : 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = 16 * (r >> 1) + g + 8 * (r & 1);
        const uint2 q = *reinterpret_cast<const uint2*>(stage + row * ROW_BYTES + codes_at + 32 * S + 8 * t);
        words[r >> 1][r & 1][0] = q.x;
        words[r >> 1][r & 1][1] = q.y;
    }
    if (KIND == KIND_Q4_K) {
        if (S == 0) {
            decode_head(*reinterpret_cast<const uint4*>(stage + lane * ROW_BYTES), table + lane * TABLE_STRIDE);
            __syncwarp();
        }
        float d_hi[2][2], e_hi[2][2];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int b = r >> 1, row = b * 16 + g + 8 * (r & 1);
            const float4 v = reinterpret_cast<const float4*>(table + row * TABLE_STRIDE)[S];
            d[b][r & 1] = v.x;
            e[b][r & 1] = v.y;
            d_hi[b][r & 1] = v.z;
            e_hi[b][r & 1] = v.w;
        }
        x_fragments(x[0], xb);
        group_sums(s, xb);
        group_mma(c, words, xb, 0, 0x43004300u);
        scale_into(acc, c, s, d, e);
        float c_hi[2][4] = {};
        x_fragments(x[1], xb);
        group_sums(s, xb);
        group_mma(c_hi, words, xb, 4, 0x43004300u);
        scale_into(acc, c_hi, s, d_hi, e_hi);
    } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = 16 * (r >> 1) + g + 8 * (r & 1);
            const float dd = f16_to_f32(*reinterpret_cast<const u16*>(stage + row * ROW_BYTES + 128 + 2 * S));
            d[r >> 1][r & 1] = dd;
            e[r >> 1][r & 1] = (HALF ? 1152.f : 2304.f) * dd;
        }
        x_fragments(x[0], xb);
        if (HALF) {
            group_mma_half<X16>(c, s, words, xb);
        } else {
            group_sums(s, xb);
            group_mma(c, words, xb, 0, 0x43004300u);
            group_mma(c, words, xb, 4, 0x45084508u);  // 2048 + 16 (h ^ 8): the byte's sign bit flipped
        }
        scale_into(acc, c, s, d, e);
    }
}

// The activations of unit S of the iteration at `xs` (8 t values on; zeros where null) into x.
template <int KIND, int S>
__device__ __forceinline__ void load_unit_x(const u16* xs, uint4 (&x)[2]) {
    x[0] = load_x(xs, S * (KIND == KIND_Q4_K ? 64 : 32));
    if (KIND == KIND_Q4_K) x[1] = load_x(xs, S * 64 + 32);
}

// Unit S of an iteration: the loads of the next unit's activations, then unit S's MMAs; `x` holds unit S's
// activations, then the next unit's (the next iteration's first where `more`).
template <int KIND, int S, bool HALF, bool X16>
__device__ __forceinline__ void unit_step(
    const u8* stage, float* table, const u16* xs, bool more, uint4 (&x)[2], float (&acc)[2][4]) {
    uint4 next[2] = {};
    if (S + 1 < UNITS) {
        load_unit_x<KIND, (S + 1) % UNITS>(xs, next);
    } else if (more && xs) {
        load_unit_x<KIND, 0>(xs + ITERATION_VALUES(KIND), next);
    }
    compute_unit<KIND, S, HALF, X16>(stage, table, x, acc);
    x[0] = next[0];
    x[1] = next[1];
}

// MODE_PER_EXPERT: warp 0 finds this block's expert's pairs in ids, in pair order (the slots group_pairs
// would give them), into slot_pair (-1 past them) and their count into slot_pair[TILE_PAIRS]. A token's
// picks are distinct experts, so a window of at most TILE_PAIRS tokens gives an expert at most that many.
__device__ __forceinline__ void find_pairs(const i64* ids, int pairs, int expert, int* slot_pair) {
    const int lane = threadIdx.x;
    int found = 0;
    for (int base = 0; base < pairs; base += 32) {
        const int pair = base + lane;
        const bool hit = pair < pairs && ids[pair] == expert;
        const u32 hits = __ballot_sync(0xFFFFFFFFu, hit);
        const int rank = found + __popc(hits & ((1u << lane) - 1u));
        if (hit && rank < TILE_PAIRS) slot_pair[rank] = pair;
        found += __popc(hits);
    }
    if (lane < TILE_PAIRS && lane >= found) slot_pair[lane] = -1;
    if (lane == 0) slot_pair[TILE_PAIRS] = found;
}

// The rows, pairs and expert of this block; false where it has none. slot_pair: TILE_PAIRS + 1 ints.
__device__ __forceinline__ bool block_pairs(
    int mode, const i64* ids, const int* tile_expert, const int* tile_pairs, int pairs, int* slot_pair,
    int& expert) {
    const int tile = blockIdx.x;
    if (mode == MODE_PER_EXPERT) {
        expert = tile;
        if (threadIdx.x < 32) find_pairs(ids, pairs, expert, slot_pair);
        __syncthreads();
        return slot_pair[TILE_PAIRS] > 0;
    }
    if (mode == MODE_PER_PAIR) {
        expert = (int)ids[tile];
    } else if (mode == MODE_TILES) {
        expert = tile_expert[tile];
    } else {
        expert = 0;
    }
    if (expert < 0) return false;
    if (threadIdx.x < TILE_PAIRS) {
        const int s = threadIdx.x;
        int pair;
        if (mode == MODE_PER_PAIR) {
            pair = s == 0 ? tile : -1;
        } else if (mode == MODE_TILES) {
            pair = tile_pairs[tile * TILE_PAIRS + s];
        } else {
            pair = tile * TILE_PAIRS + s < pairs ? tile * TILE_PAIRS + s : -1;
        }
        slot_pair[s] = pair;
    }
    __syncthreads();
    return true;
}

// k split over the blocks of gridDim.z (a dense projection of few column tiles): warp 0 of each block leaves
// its sums in `split_sums` (256 floats a block, by tile and split) and counts its arrival on its tile's
// counter; the block that arrives last adds every split's sums in split order into acc (so the total does
// not depend on which block finishes last), sets the counter back to 0 for the next launch and returns true.
// A float stored to / loaded from L2, past this SM's L1 (which another block's stores do not reach).
__device__ __forceinline__ void store_l2(float* p, float v) {
    asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");
}

__device__ __forceinline__ float load_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ bool split_total(float (&acc)[2][4], float* split_sums, int* arrivals) {
    const int lane = threadIdx.x & 31, splits = gridDim.z;
    const i64 tile = (i64)blockIdx.x * gridDim.y + blockIdx.y;
    float* sums = split_sums + tile * splits * 256 + lane * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) store_l2(sums + blockIdx.z * 256 + i, acc[i >> 2][i & 3]);
    __threadfence();  // this lane's sums visible to every block before the arrival is counted
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(arrivals + tile, 1);
    arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
    if (arrived != splits - 1) return false;
    __threadfence();  // the other blocks' sums, counted before this arrival, are read after it
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i >> 2][i & 3] = 0.f;
    for (int split = 0; split < splits; ++split) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i >> 2][i & 3] += load_l2(sums + split * 256 + i);
    }
    if (lane == 0) arrivals[tile] = 0;
    return true;
}

// X16: down's input is gate_up's fp16 (DOWN_HALF), its codes fp16 operands
template <int KIND, bool SWIGLU, int RING, bool X16 = false>
__device__ __forceinline__ void held_pairs(
    const u16* __restrict__ x, const u8* __restrict__ w, u16* __restrict__ out, const i64* __restrict__ ids,
    const int* __restrict__ tile_expert, const int* __restrict__ tile_pairs, const u16* __restrict__ scale,
    int mode, int pairs, int k, int up_rows, i64 stride_we, i64 stride_wn, i64 stride_xm, i64 stride_om,
    int x_row_div, float* __restrict__ split_sums, int* __restrict__ arrivals, int half_out) {
    extern __shared__ __align__(16) u8 shared[];
    __shared__ int slot_pair[TILE_PAIRS + 1];
    // Launched dependently: the rows kernel reads, before the kernel before it has ended, what that kernel
    // cannot have written. Its weights never change during a window, and as down (after gate_up) its pairs'
    // tiles and experts were written before gate_up began. So its blocks copy their first iterations while
    // the kernel before them finishes; gate_up's tiles come from the kernel just before it, so it waits first.
    constexpr bool early = !SWIGLU;
    // gate and up read the normed hidden state, within fp16's range; down with X16 gate_up's fp16 of
    // act / ACT_SCALE; a dense projection's input need not be in fp16's range
    constexpr bool half = KIND == KIND_Q8_0 && (SWIGLU ? Q8_HALF : X16);
    if (!early) previous_done();
    int expert;
    if (!block_pairs(mode, ids, tile_expert, tile_pairs, pairs, slot_pair, expert)) return;
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    u8* stages = shared + warp * RING * STAGE_BYTES;
    float* table = reinterpret_cast<float*>(shared + warps * RING * STAGE_BYTES) + warp * 32 * TABLE_STRIDE;
    float* partial = reinterpret_cast<float*>(shared + warps * RING * STAGE_BYTES) +
                     (KIND == KIND_Q4_K ? warps * 32 * TABLE_STRIDE : 0);
    const int pair = slot_pair[g];
    const u16* xrow = pair >= 0 ? x + (i64)(pair / x_row_div) * stride_xm : nullptr;
    const int col0 = blockIdx.y * (SWIGLU ? 16 : 32);
    const u8* base = w + (i64)expert * stride_we;
    const int second = SWIGLU ? col0 + up_rows : col0 + 16;  // block 1's first row
    const u8* copied[2] = {base + (i64)(col0 + (lane >> 3)) * stride_wn, base + (i64)(second + (lane >> 3)) * stride_wn};
    float acc[2][4] = {};
    // the block's share of k (blockIdx.z of gridDim.z splits), then each warp's of that
    const int iterations = k / ITERATION_VALUES(KIND), splits = gridDim.z;
    const int lo = iterations * blockIdx.z / splits, span = iterations * (blockIdx.z + 1) / splits - lo;
    const int first = lo + span * warp / warps, last = lo + span * (warp + 1) / warps;
    const u16* xs = xrow ? xrow + first * ITERATION_VALUES(KIND) + 8 * t : nullptr;
#pragma unroll
    for (int s = 0; s < RING - 1; ++s) {
        if (first + s < last) {
            copy_iteration<KIND>(stages + s * STAGE_BYTES, copied, 4 * stride_wn, first + s, k);
        }
        copies_sent();
    }
    if (early) previous_done();
    next_may_launch();
    uint4 unit_x[2] = {};  // the activations of the unit at hand
    load_unit_x<KIND, 0>(xs, unit_x);
    for (int it = first; it < last; ++it) {
        const int i = it - first;
        __syncwarp();  // every lane is done with the stage the next copies take
        if (it + RING - 1 < last) {
            copy_iteration<KIND>(stages + ((i + RING - 1) % RING) * STAGE_BYTES, copied, 4 * stride_wn,
                                 it + RING - 1, k);
        }
        copies_sent();
        copies_done_but_newest<RING>();
        __syncwarp();  // every lane's copies of this iteration have landed
        const u8* stage = stages + (i % RING) * STAGE_BYTES;
        const bool more = it + 1 < last;
        unit_step<KIND, 0, half, X16>(stage, table, xs, more, unit_x, acc);
        unit_step<KIND, 1, half, X16>(stage, table, xs, more, unit_x, acc);
        unit_step<KIND, 2, half, X16>(stage, table, xs, more, unit_x, acc);
        unit_step<KIND, 3, half, X16>(stage, table, xs, more, unit_x, acc);
        if (xs) xs += ITERATION_VALUES(KIND);
    }
    if (warp > 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) partial[((warp - 1) * 32 + lane) * 8 + i] = acc[i >> 2][i & 3];
    }
    __syncthreads();
    if (warp > 0) return;
    for (int p = 0; p < warps - 1; ++p) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i >> 2][i & 3] += partial[(p * 32 + lane) * 8 + i];
    }
    if (splits > 1 && !split_total(acc, split_sums, arrivals)) return;
    // acc[b][i]: row (g if i < 2 else g + 8) of block b, pair slot 2 t + (i & 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int slot_row = slot_pair[2 * t + (i & 1)];
        if (slot_row < 0) continue;
        u16* o = out + (i64)slot_row * stride_om + col0 + g + (i >> 1) * 8;
        if (SWIGLU) {
            const float gate = acc[0][i], up = acc[1][i], act = gate / (1.f + expf(-gate)) * up;
            o[0] = half_out ? f32_to_f16_finite(act * (1.f / ACT_SCALE)) : f32_to_bf16(act);
        } else {
            const float weight = (scale ? bf16_to_f32(scale[slot_row]) : 1.f) * (X16 ? ACT_SCALE : 1.f);
            o[0] = f32_to_bf16(acc[0][i] * weight);
            o[16] = f32_to_bf16(acc[1][i] * weight);
        }
    }
}

// half_out (gate_up): its output as fp16 of act / ACT_SCALE, for a Q8_0 down built with DOWN_HALF
#define HELD_ARGS                                                                                        \
    const u16 *x, const u8 *w, u16 *out, const i64 *ids, const int *tile_expert, const int *tile_pairs, \
        const u16 *scale, int mode, int pairs, int k, int up_rows, i64 stride_we, i64 stride_wn,         \
        i64 stride_xm, i64 stride_om, int x_row_div, float *split_sums, int *arrivals, int half_out
#define HELD_PASS \
    x, w, out, ids, tile_expert, tile_pairs, scale, mode, pairs, k, up_rows, stride_we, stride_wn, stride_xm, \
        stride_om, x_row_div, split_sums, arrivals, half_out

// gate_up and rows (down) take the experts' pairs; dense, a dense projection's rows (MODE_DENSE)
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q4_k_gate_up(HELD_ARGS) {
    held_pairs<KIND_Q4_K, true, STAGES>(HELD_PASS);
}
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q4_k_rows(HELD_ARGS) {
    held_pairs<KIND_Q4_K, false, DOWN_STAGES>(HELD_PASS);
}
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q4_k_dense(HELD_ARGS) {
    held_pairs<KIND_Q4_K, false, DENSE_STAGES>(HELD_PASS);
}
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q8_0_gate_up(HELD_ARGS) {
    held_pairs<KIND_Q8_0, true, STAGES>(HELD_PASS);
}
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q8_0_rows(HELD_ARGS) {
    held_pairs<KIND_Q8_0, false, DOWN_STAGES, DOWN_HALF>(HELD_PASS);
}
extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS) held_q8_0_dense(HELD_ARGS) {
    held_pairs<KIND_Q8_0, false, DENSE_STAGES>(HELD_PASS);
}

// Tiles of up to 8 pairs of one expert, in pair order (one block of a power of two threads, at least the pairs
// and the experts, at most 1,024): tile_expert[t] (-1: unused) and tile_pairs[t * 8 + s] (-1: empty slot) for
// t < tiles.
extern "C" __global__ void __launch_bounds__(1024)
    group_pairs(const i64* ids, int pairs, int experts, int tiles, int* tile_expert, int* tile_pairs) {
    __shared__ int count[1024];
    __shared__ int scan[1024];
    __shared__ int picked[1024];
    previous_done();
    next_may_launch();
    const int i = threadIdx.x;
    count[i] = 0;
    for (int tile = i; tile < tiles; tile += blockDim.x) {
        tile_expert[tile] = -1;
        for (int s = 0; s < TILE_PAIRS; ++s) tile_pairs[tile * TILE_PAIRS + s] = -1;
    }
    __syncthreads();
    const int expert = i < pairs ? (int)ids[i] : -1;
    picked[i] = expert;
    if (expert >= 0) atomicAdd(&count[expert], 1);
    __syncthreads();
    const int own = i < experts ? (count[i] + TILE_PAIRS - 1) / TILE_PAIRS : 0;
    scan[i] = own;
    for (int step = 1; step < blockDim.x; step <<= 1) {
        __syncthreads();
        const int add = i >= step ? scan[i - step] : 0;
        __syncthreads();
        scan[i] += add;
    }
    __syncthreads();
    if (expert < 0) return;
    int rank = 0;
    for (int j = 0; j < i; ++j) rank += picked[j] == expert;
    const int tile = scan[expert] - (count[expert] + TILE_PAIRS - 1) / TILE_PAIRS + rank / TILE_PAIRS;
    tile_pairs[tile * TILE_PAIRS + rank % TILE_PAIRS] = i;
    if (rank % TILE_PAIRS == 0) tile_expert[tile] = expert;
}
