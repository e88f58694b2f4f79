// Dot products of weight rows with token vectors, fp32 arithmetic, for the native CPU kernels.
//
// Weights are fp32, bf16, int8 with one fp32 scale per row (weight = int8 * scale), or GGUF's blocks as the
// file holds them: Q8_0 (blocks of 32 weights: an fp16 scale and 32 int8; weight = int8 * scale; held as a row's
// codes, then its scales: app/kernels/gguf_quants.py's `to_held`) and the i-quants IQ4_XS, IQ3_XXS and IQ3_S
// (levels or grid points of llama.cpp's tables, `Tables`, under 4- or 6-bit scales and sign bits). Each is
// widened to fp32 exactly as GGUF's own dequantizer does (every product is exact; app/kernels/gguf_quants.py
// is the reference), read row by row from contiguous memory. The K-quants (Q4_K, Q5_K, Q6_K) are not widened:
// int_dot.h sums them in integers against quantized token vectors. A pass takes R
// weight rows and C token vectors at once (R * C sums kept in registers),
// so each weight is read and widened once per C tokens and each token element once per R rows. Every product
// of a (row, token) pair goes to lane (column % LANES), and the lanes are added in one fixed tree at the end:
// a pair's result is the same whatever R and C were, so a token's result never depends on which other tokens
// or rows shared its pass (a batch never changes a row).
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace dot {

// Weight kinds, codes 0 to 9 in this order (app/kernels/cpu_experts.py's _KINDS and _HELD_KINDS).
enum class Kind : int { F32, BF16, I8, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS, IQ3_S };

constexpr int TILE = 4;    // token vectors per pass (C at most)
constexpr int LANES = 16;  // partial sums of one dot product: one AVX-512 register, two AVX2 ones
constexpr int64_t Q8_BLOCK = 32;  // Q8_0: weights a block
constexpr int64_t QK_K = 256;     // the K- and i-quants: weights a super-block
// Bytes a block of each GGUF type.
constexpr int64_t Q8_0_BYTES = 34, Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210, IQ4_XS_BYTES = 136,
                  IQ3_XXS_BYTES = 98, IQ3_S_BYTES = 110;

// The bytes of `cols` weights held as whole blocks of `values` weights and `bytes` bytes (of type `name`).
inline int64_t block_bytes(int64_t cols, int64_t values, int64_t bytes, const char* name) {
    if (cols % values) {
        throw std::invalid_argument(std::string(name) + " rows hold whole blocks of " + std::to_string(values) +
                                    " weights");
    }
    return cols / values * bytes;
}

// The bytes of one weight row of `cols` columns.
inline int64_t row_bytes(Kind kind, int64_t cols) {
    switch (kind) {
        case Kind::F32: return 4 * cols;
        case Kind::BF16: return 2 * cols;
        case Kind::I8: return cols;
        case Kind::Q8_0: return block_bytes(cols, Q8_BLOCK, Q8_0_BYTES, "Q8_0");
        case Kind::Q4_K: return block_bytes(cols, QK_K, Q4_K_BYTES, "Q4_K");
        case Kind::Q5_K: return block_bytes(cols, QK_K, Q5_K_BYTES, "Q5_K");
        case Kind::Q6_K: return block_bytes(cols, QK_K, Q6_K_BYTES, "Q6_K");
        case Kind::IQ4_XS: return block_bytes(cols, QK_K, IQ4_XS_BYTES, "IQ4_XS");
        case Kind::IQ3_XXS: return block_bytes(cols, QK_K, IQ3_XXS_BYTES, "IQ3_XXS");
        case Kind::IQ3_S: return block_bytes(cols, QK_K, IQ3_S_BYTES, "IQ3_S");
    }
    throw std::invalid_argument("unknown weight kind");
}

// The i-quants' lookup tables, llama.cpp's as the gguf package carries them, handed over once by `set_tables`
// (native/cpu_experts.cpp, called from app/kernels/cpu_experts.py) before any i-quant weight is read: IQ4_NL's
// 16 levels (IQ4_XS's values) and the grid points of IQ3_XXS (256) and IQ3_S (512), four values (bytes) each.
struct Tables {
    int8_t iq4[16];
    unsigned char iq3_xxs[256][4];
    unsigned char iq3_s[512][4];
    bool loaded = false;
};
inline Tables tables;

// Whether weights of `kind` read `tables`.
inline bool reads_tables(Kind kind) { return kind == Kind::IQ4_XS || kind == Kind::IQ3_XXS || kind == Kind::IQ3_S; }

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t v) {  // bf16: the upper half of an fp32
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// An IEEE fp16 value (a Q8_0 block's scale) as fp32, exactly: F16C's conversion where the CPU has it, else
// its bits rebuilt.
inline float half(const unsigned char* bytes) {
    uint16_t h;
    std::memcpy(&h, bytes, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

// e^x in fp32 within 2 ulp, in plain arithmetic a loop can vectorise (libm's expf is a call per element):
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), e^r by its degree-7 Taylor-like
// polynomial (Cephes' coefficients), times 2^n put straight into the exponent bits. Inputs are clamped to
// where fp32 neither overflows nor turns denormal; NaN stays NaN.
inline float exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to the nearest integer
    const float n = (x * 1.44269504088896341f + round) - round;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

inline float silu(float v) { return v / (1.0f + dot::exp(-v)); }

// A pair's partial sums, added in a fixed tree.
inline float lane_sum(const float* part) {
    float half[LANES / 2];
    for (int l = 0; l < LANES / 2; ++l) half[l] = part[l] + part[l + LANES / 2];
    for (int width = LANES / 4; width >= 1; width /= 2) {
        for (int l = 0; l < width; ++l) half[l] = half[l] + half[l + width];
    }
    return half[0];
}

// R weight rows of one element type (fp32, bf16, int8): how a pass widens LANES of row r's weights from column
// `col` to fp32, one weight alone (a row's tail), and where row r's bytes for column `col` lie.
template <int R, typename T>
struct Elements {
    const T* row[R];
    int64_t cols;  // weights a row

    void widen(int r, int64_t col, float* wide) const {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) wide[l] = dot::widen(row[r][col + l]);
    }
    float one(int r, int64_t col) const { return dot::widen(row[r][col]); }
    const void* at(int r, int64_t col) const { return row[r] + col; }
};

// LANES (16) int8 codes widened to fp32 in registers, times a step (every GGUF type the passes widen). The
// products are exact; where the compiler's own vectorisation of these loops stays with 16-byte vectors, the
// intrinsics widen 16 bytes to a whole register at once.
inline void widen_int8(const int8_t* q, float step, float* wide) {
#if defined(__AVX512F__)
    const __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    _mm512_storeu_ps(wide, _mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(step)));
#elif defined(__AVX2__)
    for (int h = 0; h < LANES; h += 8) {
        const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h)));
        _mm256_storeu_ps(wide + h, _mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(step)));
    }
#else
#pragma omp simd
    for (int l = 0; l < LANES; ++l) wide[l] = static_cast<float>(q[l]) * step;
#endif
}

// IQ4_XS's codes: the IQ4_NL levels that the nibbles at `bits` (0 or 4) of 16 bytes q pick.
inline void level_codes(const unsigned char* q, int bits, int8_t* codes) {
#if defined(__SSSE3__)
    const __m128i all = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i ids = _mm_and_si128(_mm_srl_epi16(all, _mm_cvtsi32_si128(bits)), _mm_set1_epi8(15));
    const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables.iq4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm_shuffle_epi8(levels, ids));
#else
    for (int l = 0; l < LANES; ++l) codes[l] = tables.iq4[(q[l] >> bits) & 15];
#endif
}

// The IQ3 types' codes: value l % 4 of grid point ids[l / 4] (of `grid`), negated where bit l of `signs` is set.
inline void grid_codes(const unsigned char (*grid)[4], const int* ids, unsigned signs, int8_t* codes) {
#if defined(__SSSE3__)
    const auto point = [&](int e) {
        int32_t bytes;
        std::memcpy(&bytes, grid[ids[e]], sizeof bytes);
        return bytes;
    };
    const __m128i q = _mm_setr_epi32(point(0), point(1), point(2), point(3));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m128i v = _mm_mask_sub_epi8(q, static_cast<__mmask16>(signs), _mm_setzero_si128(), q);
#else
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(signs)),
                                            _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    const __m128i negative = _mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit);  // all ones where the bit is set
    const __m128i v = _mm_sub_epi8(_mm_xor_si128(q, negative), negative);
#endif
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), v);
#else
    for (int l = 0; l < LANES; ++l) {
        const int value = grid[ids[l / 4]][l % 4];
        codes[l] = static_cast<int8_t>((signs >> l) & 1 ? -value : value);
    }
#endif
}

// IQ3_XXS's sign byte of a 7-bit sign id: the id, its eighth bit set where the id has an odd number of bits
// (llama.cpp's ksigns table, computed).
inline unsigned xxs_signs(unsigned id) { return id | (static_cast<unsigned>(__builtin_popcount(id)) & 1u) << 7; }

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define DOT_AVX512_VBMI 1
// 64 IQ3_XXS codes at once: value l % 4 of grid point ids[l / 4] (16 ids), negated where bit l of `signs` is
// set. The grid's 1,024 bytes are eight tables of 128 (32 points each), each looked up by a two-register byte
// permute and kept where an id's top three bits name it: a few instructions for 64 values where a point's
// four bytes were loaded and inserted one point at a time (on this repository's VM one row of an expert took
// 485 us against 760; a gather of the 16 points, as IQ3_S's, 680).
inline void xxs_codes_64(const unsigned char* ids, uint64_t signs, int8_t* codes) {
    const __m512i which = _mm512_set_epi64(0x0f0f0f0f0e0e0e0e, 0x0d0d0d0d0c0c0c0c, 0x0b0b0b0b0a0a0a0a,
                                           0x0909090908080808, 0x0707070706060606, 0x0505050504040404,
                                           0x0303030302020202, 0x0101010100000000);  // value l: id l / 4
    const __m512i spread =
        _mm512_permutexvar_epi8(which, _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ids))));
    const __m512i table = _mm512_and_si512(_mm512_srli_epi16(spread, 5), _mm512_set1_epi8(7));
    const __m512i within = _mm512_set1_epi32(0x03020100);  // value l % 4 of its point
    const __m512i at = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(spread, _mm512_set1_epi8(31)), 2), within);
    const unsigned char* grid = tables.iq3_xxs[0];
    __m512i out = _mm512_setzero_si512();
    for (int t = 0; t < 8; ++t) {
        const __m512i first = _mm512_loadu_si512(grid + 128 * t), second = _mm512_loadu_si512(grid + 128 * t + 64);
        const __mmask64 here = _mm512_cmpeq_epi8_mask(table, _mm512_set1_epi8(static_cast<char>(t)));
        out = _mm512_mask_mov_epi8(out, here, _mm512_permutex2var_epi8(first, at, second));
    }
    _mm512_storeu_si512(codes, _mm512_mask_sub_epi8(out, signs, _mm512_setzero_si512(), out));
}
#endif
#if defined(__AVX512BW__)
#define DOT_AVX512_BW 1
// 64 IQ3_S codes at once: its 16 grid points (ids: the low bytes `low`, bit i of `ninth` id i's ninth bit)
// gathered in one load, negated where bit l of `signs` is set (on this repository's VM one row of an expert
// took 485 us against 830; sixteen byte-permute tables, as IQ3_XXS's eight, 800).
inline void s_codes_64(const unsigned char* low, unsigned ninth, uint64_t signs, int8_t* codes) {
    __m512i ids = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low)));
    ids = _mm512_mask_or_epi32(ids, static_cast<__mmask16>(ninth), ids, _mm512_set1_epi32(256));
    const __m512i points = _mm512_i32gather_epi32(ids, tables.iq3_s[0], 4);
    _mm512_storeu_si512(codes, _mm512_mask_sub_epi8(points, signs, _mm512_setzero_si512(), points));
}
#endif

// R rows of GGUF blocks of VALUES weights and BYTES bytes each, widened LANES weights at a time by Reader's
// `widen` (row r, from column `col`, a multiple of LANES: LANES divides every group of weights that shares a
// scale, so a pass's weights share one). A pass prefetches the bytes of its share of the row; rows hold whole
// blocks, so passes are whole and `one` (a pass's weight alone) serves only the generic tail they never reach.
template <int R, int64_t VALUES, int64_t BYTES, typename Reader>
struct Blocks {
    const unsigned char* row[R];
    int64_t cols;  // weights a row

    const unsigned char* block(int r, int64_t col) const { return row[r] + col / VALUES * BYTES; }
    const void* at(int r, int64_t col) const { return row[r] + col * BYTES / VALUES; }
    float one(int r, int64_t col) const {
        float wide[LANES];
        static_cast<const Reader*>(this)->widen(r, col - col % LANES, wide);
        return wide[col % LANES];
    }
};

// R held Q8_0 rows: a block's weights widened with its scale (int8 * scale, in fp32), the values GGUF's own
// dequantizer gives, so a row sums as its dequantized fp32 copy does. A held row is its blocks' codes, then
// their scales.
template <int R>
struct Q8Blocks : Blocks<R, Q8_BLOCK, Q8_0_BYTES, Q8Blocks<R>> {
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* row = this->row[r];
        widen_int8(reinterpret_cast<const int8_t*>(row + col), half(row + this->cols + col / Q8_BLOCK * 2),
                   wide);
    }
};

// R IQ4_XS rows: super-blocks of an fp16 d, the high bit pairs of eight 6-bit scales (16 bits), their low
// nibbles (4 bytes), and per group j of 32 weights 16 bytes of 4-bit ids of IQ4_NL levels (low nibbles: its
// first 16 weights, high: the next 16); weight = (d * (scale - 32)) * level.
template <int R>
struct IQ4XSBlocks : Blocks<R, QK_K, IQ4_XS_BYTES, IQ4XSBlocks<R>> {
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* b = this->block(r, col);
        const int in = static_cast<int>(col % QK_K), j = in / 32;
        int8_t codes[LANES];
        level_codes(b + 8 + 16 * j, 4 * (in % 32 / 16), codes);
        widen_int8(codes, step(b, j), wide);
    }
    // The step (d * (scale - 32)) of group j of super-block b.
    static float step(const unsigned char* b, int j) {
        const int scale = ((b[4 + j / 2] >> 4 * (j % 2)) & 15) | (((b[2] | b[3] << 8) >> 2 * j) & 3) << 4;
        return half(b) * static_cast<float>(scale - 32);
    }
#ifdef DOT_AVX512_VBMI
    static constexpr int STEP = 32;  // values a step of `super_codes` serves
    // Super-block b's 256 codes and its eight groups' steps (`widen`'s): two groups' 64 levels a byte permute.
    static void super_codes(const unsigned char* b, int8_t* codes, float* steps) {
        for (int j = 0; j < 8; ++j) steps[j] = step(b, j);
        const __m512i levels = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tables.iq4)));
        // a group's 16 bytes twice: low nibbles (its first 16 weights), then high (the next 16)
        const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                                0x0004000400040004, 0, 0);
        for (int q = 0; q < 4; ++q) {
            const __m512i two = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 8 + 32 * q)));
            const __m512i twice = _mm512_shuffle_i64x2(two, two, _MM_SHUFFLE(1, 1, 0, 0));
            const __m512i ids = _mm512_and_si512(_mm512_srlv_epi16(twice, shifts), _mm512_set1_epi8(15));
            _mm512_storeu_si512(codes + 64 * q, _mm512_permutexvar_epi8(ids, levels));
        }
    }
#endif
};

// R IQ3_XXS rows: super-blocks of an fp16 d, 64 ids of IQ3_XXS grid points (four weights each), and per group j
// of 32 weights a 32-bit word: four 7-bit sign ids (eight weights each, `xxs_signs`) and a 4-bit scale s;
// weight = (d * (0.5 + s) * 0.5) * point value, negated by its sign bit.
template <int R>
struct IQ3XXSBlocks : Blocks<R, QK_K, IQ3_XXS_BYTES, IQ3XXSBlocks<R>> {
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* b = this->block(r, col);
        const int in = static_cast<int>(col % QK_K), first = in / 4, k = in % 32 / 8;
        uint32_t word;
        std::memcpy(&word, b + 66 + 4 * (in / 32), sizeof word);
        const unsigned signs = xxs_signs((word >> 7 * k) & 127) | xxs_signs((word >> 7 * (k + 1)) & 127) << 8;
        const int ids[4] = {b[2 + first], b[3 + first], b[4 + first], b[5 + first]};
        int8_t codes[LANES];
        grid_codes(tables.iq3_xxs, ids, signs, codes);
        widen_int8(codes, step(b, word), wide);
    }
    // The step (d * (0.5 + s) * 0.5) of the group whose 32-bit word is `word`, of super-block b.
    static float step(const unsigned char* b, uint32_t word) {
        return half(b) * (0.5f + static_cast<float>(word >> 28)) * 0.5f;
    }
#ifdef DOT_AVX512_VBMI
    static constexpr int STEP = 32;  // values a step of `super_codes` serves
    // Super-block b's 256 codes and its eight groups' steps (`widen`'s, 64 values a lookup).
    static void super_codes(const unsigned char* b, int8_t* codes, float* steps) {
        uint32_t words[8];
        std::memcpy(words, b + 66, sizeof words);
        for (int j = 0; j < 8; ++j) steps[j] = step(b, words[j]);
        uint64_t signs[4];  // a sign bit a weight: `xxs_signs` of the groups' four 7-bit ids, eight groups at once
#if defined(__AVX512BITALG__) && defined(__AVX512VL__)
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)), seven = _mm256_set1_epi32(127);
        __m256i ids = _mm256_and_si256(all, seven);
        for (int k = 1; k < 4; ++k) {
            ids = _mm256_or_si256(ids, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(all, 7 * k), seven), 8 * k));
        }
        const __m256i odd = _mm256_and_si256(_mm256_popcnt_epi8(ids), _mm256_set1_epi8(1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(signs), _mm256_or_si256(ids, _mm256_slli_epi16(odd, 7)));
#else
        for (int q = 0; q < 4; ++q) {
            signs[q] = 0;
            for (int k = 0; k < 8; ++k) {
                signs[q] |= static_cast<uint64_t>(xxs_signs((words[2 * q + k / 4] >> 7 * (k % 4)) & 127)) << 8 * k;
            }
        }
#endif
        for (int q = 0; q < 4; ++q) xxs_codes_64(b + 2 + 16 * q, signs[q], codes + 64 * q);
    }
#endif
};

// R IQ3_S rows: super-blocks of an fp16 d, the low bytes of 64 9-bit ids of IQ3_S grid points (four weights
// each), their ninth bits (8 bytes: bit i of byte g for id 8g + i), a sign bit per weight (32 bytes) and a 4-bit
// scale s per group of 32 (4 bytes: low nibble, then high); weight = (d * (1 + 2s)) * point value, negated by
// its sign bit.
template <int R>
struct IQ3SBlocks : Blocks<R, QK_K, IQ3_S_BYTES, IQ3SBlocks<R>> {
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* b = this->block(r, col);
        const int in = static_cast<int>(col % QK_K), first = in / 4, j = in / 32;
        const int ninth = b[66 + first / 8] >> (first % 8);
        int ids[4];
        for (int e = 0; e < 4; ++e) ids[e] = b[2 + first + e] | ((ninth >> e) & 1) << 8;
        const unsigned signs = b[74 + in / 8] | b[75 + in / 8] << 8;
        int8_t codes[LANES];
        grid_codes(tables.iq3_s, ids, signs, codes);
        widen_int8(codes, step(b, j), wide);
    }
    // The step (d * (1 + 2s)) of group j of super-block b.
    static float step(const unsigned char* b, int j) {
        return half(b) * static_cast<float>(1 + 2 * ((b[106 + j / 2] >> 4 * (j % 2)) & 15));
    }
#ifdef DOT_AVX512_BW
    static constexpr int STEP = 32;  // values a step of `super_codes` serves
    // Super-block b's 256 codes and its eight groups' steps (`widen`'s, 64 values a gather).
    static void super_codes(const unsigned char* b, int8_t* codes, float* steps) {
        for (int j = 0; j < 8; ++j) steps[j] = step(b, j);
        for (int q = 0; q < 4; ++q) {
            uint64_t signs;
            std::memcpy(&signs, b + 74 + 8 * q, sizeof signs);
            s_codes_64(b + 2 + 16 * q, b[66 + 2 * q] | b[67 + 2 * q] << 8, signs, codes + 64 * q);
        }
    }
#endif
};

// Whether a reader decodes a whole super-block's codes at once (`super_codes`, then a pass widens its share under
// its group's step: the i-quants with AVX-512, 64 codes a lookup, IQ3's `xxs_codes_64` and `s_codes_64`).
template <typename Rows, typename = void>
struct has_super_codes : std::false_type {};
template <typename Rows>
struct has_super_codes<Rows, std::void_t<decltype(&Rows::super_codes)>> : std::true_type {};

// part[r][c] += one pass's widened weights of each row times token vector c from column `col`.
template <int R, int C>
inline void add_pass(float (&part)[R][C][LANES], const float (&wide)[R][LANES], const float* const* xs, int64_t col) {
    for (int c = 0; c < C; ++c) {
        const float* x = xs[c] + col;
        for (int r = 0; r < R; ++r) {
#pragma omp simd
            for (int l = 0; l < LANES; ++l) part[r][c][l] += wide[r][l] * x[l];
        }
    }
}

// out[r][c] = w[r] . xs[c] over `cols` columns, for R rows and C token vectors. With `ahead` (R rows of the
// next pass, or null) those rows are prefetched at the pace this pass reads its own: weights come from memory
// once per decode step, and short rows give the hardware's prefetcher no time to find the stream.
template <int R, int C, typename Rows>
inline void dot_block(const Rows& w, int64_t cols, const float* const* xs, float (*out)[TILE], const Rows* ahead) {
    float part[R][C][LANES] = {};
    const int64_t full = cols - cols % LANES;
    int64_t col = 0;
    if constexpr (has_super_codes<Rows>::value) {
        for (; col + QK_K <= full; col += QK_K) {
            alignas(64) int8_t codes[R][QK_K];
            float steps[R][QK_K / Rows::STEP];
            for (int r = 0; r < R; ++r) Rows::super_codes(w.block(r, col), codes[r], steps[r]);
            for (int at = 0; at < QK_K; at += LANES) {
                if (ahead) {
                    for (int r = 0; r < R; ++r) __builtin_prefetch(ahead->at(r, col + at));
                }
                float wide[R][LANES];
                for (int r = 0; r < R; ++r) widen_int8(codes[r] + at, steps[r][at / Rows::STEP], wide[r]);
                add_pass<R, C>(part, wide, xs, col + at);
            }
        }
    }
    for (; col < full; col += LANES) {
        if (ahead) {
            for (int r = 0; r < R; ++r) __builtin_prefetch(ahead->at(r, col));
        }
        float wide[R][LANES];
        for (int r = 0; r < R; ++r) w.widen(r, col, wide[r]);
        add_pass<R, C>(part, wide, xs, col);
    }
    for (int64_t tail = full; tail < cols; ++tail) {
        for (int r = 0; r < R; ++r) {
            for (int c = 0; c < C; ++c) part[r][c][tail - full] += w.one(r, tail) * xs[c][tail];
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) out[r][c] = lane_sum(part[r][c]);
    }
}

// A row-major weight matrix: rows of `cols` weights of `kind`, with one fp32 scale per row for int8.
struct Matrix {
    const char* data = nullptr;
    Kind kind = Kind::F32;
    int64_t cols = 0;
    const float* scales = nullptr;

    const char* row(int64_t r) const { return data + r * row_bytes(kind, cols); }
    float scale(int64_t r) const { return scales ? scales[r] : 1.0f; }
};

// Raw row pointers, each of `cols` weights, as a reader of R rows of its kind.
template <typename Rows, int R>
inline Rows reader(const char* const* rows, int64_t cols) {
    Rows w;
    for (int r = 0; r < R; ++r) w.row[r] = reinterpret_cast<std::remove_reference_t<decltype(w.row[0])>>(rows[r]);
    w.cols = cols;
    return w;
}

template <int R, typename Rows>
inline void dot_as(const char* const* rows, int64_t cols, const float* const* xs, int count, float (*out)[TILE],
                   const char* const* ahead) {
    const Rows w = reader<Rows, R>(rows, cols);
    Rows next;
    if (ahead) next = reader<Rows, R>(ahead, cols);
    const Rows* prefetch = ahead ? &next : nullptr;
    switch (count) {
        case 1: dot_block<R, 1>(w, cols, xs, out, prefetch); break;
        case 2: dot_block<R, 2>(w, cols, xs, out, prefetch); break;
        case 3: dot_block<R, 3>(w, cols, xs, out, prefetch); break;
        default: dot_block<R, TILE>(w, cols, xs, out, prefetch); break;
    }
}

// f called with an unset reader of R rows of `kind`: a generic f thus runs with the reader's type.
template <int R, typename F>
inline void by_kind(Kind kind, F f) {
    switch (kind) {
        case Kind::F32: return f(Elements<R, float>{});
        case Kind::BF16: return f(Elements<R, uint16_t>{});
        case Kind::I8: return f(Elements<R, int8_t>{});
        case Kind::Q8_0: return f(Q8Blocks<R>{});
        case Kind::Q4_K:
        case Kind::Q5_K:
        case Kind::Q6_K: throw std::invalid_argument("Q4_K, Q5_K and Q6_K rows sum in integers (int_dot.h)");
        case Kind::IQ4_XS: return f(IQ4XSBlocks<R>{});
        case Kind::IQ3_XXS: return f(IQ3XXSBlocks<R>{});
        case Kind::IQ3_S: return f(IQ3SBlocks<R>{});
    }
    throw std::invalid_argument("unknown weight kind");
}

// out[r][c] = rows[r] . xs[c] for R weight rows of one kind (unscaled) and `count` (1 to TILE) token vectors,
// prefetching the R rows `ahead` (null: none) meanwhile.
template <int R>
inline void dot_rows(Kind kind, const char* const* rows, int64_t cols, const float* const* xs, int count,
                     float (*out)[TILE], const char* const* ahead = nullptr) {
    by_kind<R>(kind, [&](auto w) { dot_as<R, decltype(w)>(rows, cols, xs, count, out, ahead); });
}

template <int R, typename Rows>
inline void widen_all(const char** rows, int64_t cols, float* buffer) {
    const Rows w = reader<Rows, R>(rows, cols);
    const int64_t full = cols - cols % LANES;
    for (int r = 0; r < R; ++r) {
        float* wide = buffer + r * cols;
        int64_t col = 0;
        if constexpr (has_super_codes<Rows>::value) {
            for (; col + QK_K <= full; col += QK_K) {
                alignas(64) int8_t codes[QK_K];
                float steps[QK_K / Rows::STEP];
                Rows::super_codes(w.block(r, col), codes, steps);
                for (int at = 0; at < QK_K; at += LANES) widen_int8(codes + at, steps[at / Rows::STEP], wide + col + at);
            }
        }
        for (; col < full; col += LANES) w.widen(r, col, wide + col);
        for (int64_t tail = full; tail < cols; ++tail) wide[tail] = w.one(r, tail);
        rows[r] = reinterpret_cast<const char*>(wide);
    }
}

// Points `rows` (R rows of `kind`) at fp32 copies in `buffer` [R * cols] when more than one pass of TILE token
// vectors will read them, so that each weight is widened once rather than once a pass (exact: the same
// values); returns the kind the rows then have.
template <int R>
inline Kind widen_rows(Kind kind, const char** rows, int64_t cols, int64_t readers, float* buffer) {
    if (kind == Kind::F32 || readers <= TILE) return kind;
    by_kind<R>(kind, [&](auto w) { widen_all<R, decltype(w)>(rows, cols, buffer); });
    return Kind::F32;
}

// y[k * y_stride + j + r] = (row j + r of w) . x[k] (+ bias[j + r]) for the four rows from j = 4 * quad (fewer
// at the end of w's `rows`) and the n token vectors of x (`w.cols` apart), TILE vectors a pass, the next four
// rows prefetched on the last pass.
inline void project_quad(const Matrix& w, int64_t rows, int64_t quad, const float* x, int64_t n, float* y,
                         int64_t y_stride, const float* bias = nullptr) {
    const int64_t j = 4 * quad;
    const int here = static_cast<int>(rows - j < 4 ? rows - j : 4);
    for (int64_t first = 0; first < n; first += TILE) {
        const int count = static_cast<int>(n - first < TILE ? n - first : TILE);
        const float* xs[TILE];
        for (int k = 0; k < count; ++k) xs[k] = x + (first + k) * w.cols;
        float acc[4][TILE];
        if (here == 4) {
            const char* own[4] = {w.row(j), w.row(j + 1), w.row(j + 2), w.row(j + 3)};
            const bool next = first + TILE >= n && j + 8 <= rows;
            const char* ahead[4] = {w.row(j + 4), w.row(j + 5), w.row(j + 6), w.row(j + 7)};
            dot_rows<4>(w.kind, own, w.cols, xs, count, acc, next ? ahead : nullptr);
        } else {
            for (int r = 0; r < here; ++r) {
                const char* one[1] = {w.row(j + r)};
                dot_rows<1>(w.kind, one, w.cols, xs, count, &acc[r]);
            }
        }
        for (int r = 0; r < here; ++r) {
            for (int k = 0; k < count; ++k) {
                y[(first + k) * y_stride + j + r] = acc[r][k] * w.scale(j + r) + (bias ? bias[j + r] : 0.0f);
            }
        }
    }
}

}  // namespace dot
