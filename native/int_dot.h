// Integer dot products of Q4_K, Q5_K and Q6_K weight rows with token vectors quantized to int8, for the CPU
// expert pool.
//
// Widening every weight to fp32 made a Q4_K expert compute-bound on the CPU (about a third of the memory's
// speed: a conversion and a multiply-add a weight). Here a token vector is quantized once a call, a super-block
// (256 values) at a time: step = its largest magnitude / 127, code = x * (1 / step) rounded to the nearest
// integer, ties to even (all zero where the block is), and a super-block of weights sums as
//
//   step * (d * sum_j scale_j * (q . code)_j  -  dmin * sum_j min_j * (sum of codes)_j)     (groups j of 32)
//
// with both sums exact in integers: the dot product of GGUF's dequantized weights with the quantized vector
// (code * step), as app/kernels/cpu_experts.py's reference computes it. Nibbles and codes meet 64 at a time in
// byte multiply-adds (unsigned nibble times signed code, pairs added in 16 bits: at most 2 * 15 * 127), then
// pairs of those times their group's scale (in 32 bits); a super-block's 16 int32 lanes are added, in fp32,
// to a row's partial sums as lanes * (d * step) and the min sums as lanes * (dmin * step), each a fused
// multiply-add in a fixed lane, and the lanes in one fixed tree at the end (`lane_sum`). With AVX2 (a row at a
// time, its lanes in two registers) and in plain loops elsewhere, the same integers and the same fused
// operations give the same bits.
//
// Codes are stored in the order the super-block's 128 bytes of nibbles hold the weights when read 64 bytes at
// a time: for each half h (values 128h ..) its values [0, 32) and [64, 96) (the low nibbles of 64 bytes), then
// [32, 64) and [96, 128) (their high nibbles).
//
// Q5_K holds the same fields and nibbles (at byte 48, not 16) and a fifth bit a weight in the 32 bytes before
// them: value 64j + l's low nibble takes bit 2j of byte l, value 64j + 32 + l's high nibble bit 2j + 1. The
// bit adds 16 to the nibble's byte before the multiply-adds (at most 2 * 31 * 127 a pair, still in 16 bits);
// the rest is Q4_K's arithmetic.
//
// Q6_K (6-bit q, weight = d * scale_g * (q - 32), sixteen int8 scales for groups g of 16 values) reads its codes
// in the values' own order: a half's 64 low bytes hold values [0, 64) in their low nibbles and [64, 128) in
// their high ones, each under a bit pair of the half's 32 high bytes. A super-block sums as
//
//   step * d * sum_g scale_g * ((q . code)_g - 32 * (sum of codes)_g)
//
// the byte multiply-adds giving q . code by pairs (at most 2 * 63 * 127) less 32 times each pair's codes (kept
// with the quantized vector: `Quantized::pairs`), so every pair is (q - 32) . code exactly; then the pairs times
// their group's scale into the same 16 int32 lanes as Q4_K's (lane l: bytes 4l .. 4l + 3 of each of the four
// 64-byte vectors), a lane at most 4 * 2 * 2 * 32 * 127 * 128 in magnitude (exact in fp32), added as
// fma(lane, d * step, part) and summed by `lane_sum`. No mins.
#pragma once

#include "dot.h"

#include <vector>

namespace dot {

// A token vector quantized for Q4_K, Q5_K or Q6_K rows (`quantize`).
struct Quantized {
    int8_t* codes;   // one a value, in the nibbles' order (Q4_K, Q5_K) or the values' (Q6_K)
    float* steps;    // one a super-block
    int16_t* sums;   // each group of 32 values' codes added, in the values' order
    int16_t* pairs;  // Q6_K's: each pair of codes (in their order) added, times 32; else null
};

// n token vectors of up to `cols` values each, quantized; with `paired`, room for Q6_K's pair sums.
struct QuantizedRows {
    int64_t cols;
    std::vector<int8_t> codes;
    std::vector<float> steps;
    std::vector<int16_t> sums, pairs;

    QuantizedRows(int64_t n, int64_t cols_, bool paired)
        : cols(cols_), codes(static_cast<size_t>(n * cols_)), steps(static_cast<size_t>(n * (cols_ / QK_K))),
          sums(static_cast<size_t>(n * (cols_ / 32))), pairs(paired ? static_cast<size_t>(n * (cols_ / 2)) : 0) {}

    // Token vector k, its pair sums named only `paired` (for Q6_K rows).
    Quantized at(int64_t k, bool paired) {
        return {&codes[k * cols], &steps[k * (cols / QK_K)], &sums[k * (cols / 32)],
                paired ? &pairs[k * (cols / 2)] : nullptr};
    }
};

// Where value i (0..255) of a super-block lies among its stored codes.
inline int code_position(int i) {
    const int half = i / 128, stretch = i % 128 / 64, within = i % 64;
    return 128 * half + (within < 32 ? 32 * stretch + within : 64 + 32 * stretch + within - 32);
}

// Where value i of a super-block lies among the codes of `kind`'s rows: Q6_K's in the values' order.
inline int code_position(Kind kind, int i) { return kind == Kind::Q6_K ? i : code_position(i); }

// x [cols] (a multiple of QK_K) quantized into q for rows of `kind` (Q4_K, Q5_K or Q6_K); Q6_K's pair sums too.
// A NaN's code is 0 (and a NaN gives no block its step).
inline void quantize(const float* x, int64_t cols, Kind kind, const Quantized& q) {
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        const float* v = x + b * QK_K;
#if defined(__AVX512F__)
        __m512 largest = _mm512_setzero_ps();  // vmaxps gives its second operand where either is a NaN
        for (int i = 0; i < QK_K; i += 16) largest = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + i)), largest);
        const float most = _mm512_reduce_max_ps(largest);
#else
        float most = 0.0f;
        for (int i = 0; i < QK_K; ++i) most = std::fmax(most, std::fabs(v[i]));
#endif
        const float step = most / 127.0f;
        const float inverse = step > 0.0f ? 1.0f / step : 0.0f;
        q.steps[b] = step;
        int8_t* codes = q.codes + b * QK_K;
        int16_t* sums = q.sums + b * 8;
        for (int j = 0; j < 8; ++j) {
#if defined(__AVX512F__)
            // 32 values: two registers' products rounded as the current mode says (to the nearest, ties to even)
            __m512i both = _mm512_setzero_si512();
            for (int h = 0; h < 2; ++h) {
                const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(v + 32 * j + 16 * h), _mm512_set1_ps(inverse));
                const __mmask16 real = _mm512_cmp_ps_mask(scaled, scaled, _CMP_ORD_Q);
                __m512i ints = _mm512_maskz_cvtps_epi32(real, scaled);
                ints = _mm512_max_epi32(_mm512_min_epi32(ints, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + code_position(kind, 32 * j + 16 * h)),
                                 _mm512_cvtepi32_epi8(ints));
                both = _mm512_add_epi32(both, ints);
            }
            sums[j] = static_cast<int16_t>(_mm512_reduce_add_epi32(both));
#else
            int sum = 0;
            for (int i = 32 * j; i < 32 * j + 32; ++i) {
                const float r = std::nearbyint(v[i] * inverse);
                const int code = r > 127.0f ? 127 : (r < -127.0f ? -127 : (r == r ? static_cast<int>(r) : 0));
                codes[code_position(kind, i)] = static_cast<int8_t>(code);
                sum += code;
            }
            sums[j] = static_cast<int16_t>(sum);
#endif
        }
        if (q.pairs) {
            int16_t* pairs = q.pairs + b * (QK_K / 2);
            for (int i = 0; i < QK_K / 2; ++i) pairs[i] = static_cast<int16_t>(32 * (codes[2 * i] + codes[2 * i + 1]));
        }
    }
}

// The eight 6-bit scales (bytes 0-7) and mins (8-15) of a Q4_K super-block's 12 packed bytes: groups 0-3 hold
// theirs in the low six bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7 in the nibbles of bytes 8-11
// (scale low, min high), under the top two bits of bytes 0-3 (scales) and 4-7 (mins).
inline void q4k_fields(const unsigned char* packed, uint8_t* scales, uint8_t* mins) {
    uint32_t w[3];
    std::memcpy(w, packed, sizeof w);
    const uint32_t low6 = 0x3f3f3f3fu, nibble = 0x0f0f0f0fu, top2 = 0x30303030u;
    const uint32_t s[2] = {w[0] & low6, (w[2] & nibble) | ((w[0] >> 2) & top2)};
    const uint32_t m[2] = {w[1] & low6, ((w[2] >> 4) & nibble) | ((w[1] >> 2) & top2)};
    std::memcpy(scales, s, 8);
    std::memcpy(mins, m, 8);
}

// The group of lane `lane` (0..15) of byte vector v (0..3: low then high nibbles of the first 64 bytes, then of
// the next 64) of a super-block.
inline int q4k_group(int v, int lane) { return 4 * (v / 2) + 2 * (lane / 8) + v % 2; }

// The parts of a row's sum: part[l] (l < 16) gathers lane l of its super-blocks' scaled sums, each added as
// fma(lane, d * step, part); least[k] (k < 4) pair k of their min sums (min_2k * sums_2k + min_2k+1 * sums_2k+1),
// each added as fma(pair, dmin * step, least). The row's value: the lanes' tree less the pairs' (`q4k_value`).
inline float q4k_value(const float* part, const float* least) {
    return lane_sum(part) - ((least[0] + least[1]) + (least[2] + least[3]));
}

#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define INT_DOT_AVX512 1
// The first 16 bytes (d, dmin, the packed scales and mins) of R <= 4 super-blocks, one a 128-bit lane, turned
// into d and dmin in fp32 (`scales`: d_r at 2r, dmin_r at 2r + 1) and lane r holding row r's eight scales,
// then its eight mins (bytes; `q4k_fields` four rows at once).
template <int R>
inline __m512i q4k_heads(const unsigned char* const* blocks, float* scales) {
    __m512i heads = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[0])));
    if constexpr (R > 1) heads = _mm512_inserti32x4(heads, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[1])), 1);
    if constexpr (R > 2) heads = _mm512_inserti32x4(heads, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[2])), 2);
    if constexpr (R > 3) heads = _mm512_inserti32x4(heads, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[3])), 3);
    // each lane's d and dmin (its first dword) side by side, widened
    const __m256i halves = _mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), heads));
    _mm512_storeu_ps(scales, _mm512_cvtph_ps(halves));
    // per lane, dwords w0 w1 w2 = the packed bytes: [w0 & low6, (w2 & nibble) | (w0 >> 2 & top2),
    //                                                  w1 & low6, (w2 >> 4 & nibble) | (w1 >> 2 & top2)]
    const __m512i spread = _mm512_shuffle_epi32(heads, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(3, 2, 3, 1)));  // w0 w2 w1 w2
    const __m512i tops = _mm512_shuffle_epi32(heads, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(2, 2, 1, 1)));    // w0 w0 w1 w1
    const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(spread, _mm512_set4_epi32(4, 0, 0, 0)),
                                         _mm512_set4_epi32(0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(tops, 2), _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0));
    return _mm512_or_si512(low, high);
}
#endif

// Whether rows of `kind` sum in integers here (`qk_rows`).
inline bool integer_kind(Kind kind) { return kind == Kind::Q4_K || kind == Kind::Q5_K || kind == Kind::Q6_K; }

// The bit of a Q5_K super-block's fifth-bit byte l that belongs to lane t (0..63: byte t % 32) of byte vector v
// (as `q4k_group`'s).
constexpr int q5k_bit(int v, int t) { return 4 * (v / 2) + 2 * (t / 32) + v % 2; }

// out[r][c] = rows[r] . xs[c] for R rows of K (Q4_K or Q5_K) of `cols` weights and C quantized token vectors;
// the R rows `ahead` (or null) prefetched meanwhile.
template <Kind K, int R, int C>
inline void qk_block(const unsigned char* const* rows, int64_t cols, const Quantized* xs, float (*out)[TILE],
                     const unsigned char* const* ahead) {
    static_assert(K == Kind::Q4_K || K == Kind::Q5_K, "Q4_K or Q5_K rows");
    constexpr bool FIVE = K == Kind::Q5_K;
    constexpr int64_t BYTES = FIVE ? Q5_K_BYTES : Q4_K_BYTES;
    constexpr int NIBBLES = FIVE ? 48 : 16;  // where a super-block's nibbles start
    alignas(64) float part[R][C][LANES];
    alignas(64) float least[C][16];  // row r's pairs at 4r .. 4r + 3
#ifdef INT_DOT_AVX512
    __m512 acc[R][C], mins[C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) mins[c] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    // a vector's scales as int16: its first 16 lanes group a's, the next 16 group b's, of the row in lane r
    const auto pick = [](int r, int a, int b) {
        return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(16 * r + a)),
                                  _mm256_set1_epi16(static_cast<short>(16 * r + b)), 1);
    };
    const __mmask64 even = 0x5555555555555555ull;  // the low byte of each int16
    // the mins of row r (bytes 8-15 of lane r) as int16 at lanes 8r .. 8r + 7
    const __m512i min_picks = _mm512_set_epi64(0x003f003e003d003cll, 0x003b003a00390038ll, 0x002f002e002d002cll,
                                               0x002b002a00290028ll, 0x001f001e001d001cll, 0x001b001a00190018ll,
                                               0x000f000e000d000cll, 0x000b000a00090008ll);
    // row r's dmin * step at lanes 4r .. 4r + 3
    const __m512i dmin_picks = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        const unsigned char* blocks[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            blocks[r] = rows[r] + b * BYTES;
            if (ahead) {
                const unsigned char* next = ahead[r] + b * BYTES;
                __builtin_prefetch(next);
                __builtin_prefetch(next + 64);
                __builtin_prefetch(next + 128);
            }
        }
        alignas(64) float scales[16];
        const __m512i fields = q4k_heads<R>(blocks, scales);
        const __m512i all_mins = _mm512_maskz_permutexvar_epi8(even, min_picks, fields);
        const __m256 heads = _mm256_load_ps(scales);
        alignas(32) float scaled[C][8];  // per token: d_r * step at 2r, dmin_r * step at 2r + 1
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
            const float step = xs[c].steps[b];
            const __m256 both = _mm256_mul_ps(heads, _mm256_set1_ps(step));
            _mm256_store_ps(scaled[c], both);
            const __m512i sums = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[c].sums + 8 * b)));
            const __m512 pairs = _mm512_cvtepi32_ps(_mm512_madd_epi16(all_mins, sums));
            const __m512 dmins = _mm512_permutexvar_ps(dmin_picks, _mm512_castps256_ps512(both));
            mins[c] = _mm512_fmadd_ps(pairs, dmins, mins[c]);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const __m512i first = _mm512_loadu_si512(blocks[r] + NIBBLES), second = _mm512_loadu_si512(blocks[r] + NIBBLES + 64);
            __m512i nibbles[4] = {_mm512_and_si512(first, low), _mm512_and_si512(_mm512_srli_epi16(first, 4), low),
                                  _mm512_and_si512(second, low), _mm512_and_si512(_mm512_srli_epi16(second, 4), low)};
            if constexpr (FIVE) {  // each lane's fifth bit: 16 added where it is set
                const __m512i fifth = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[r] + 16)));
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v) {
                    const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << q5k_bit(v, 0))),
                                                            _mm256_set1_epi8(static_cast<char>(1 << q5k_bit(v, 32))), 1);
                    nibbles[v] = _mm512_mask_add_epi8(nibbles[v], _mm512_test_epi8_mask(fifth, bits), nibbles[v],
                                                      _mm512_set1_epi8(16));
                }
            }
            const __m512i steps[4] = {_mm512_maskz_permutexvar_epi8(even, pick(r, 0, 2), fields),
                                      _mm512_maskz_permutexvar_epi8(even, pick(r, 1, 3), fields),
                                      _mm512_maskz_permutexvar_epi8(even, pick(r, 4, 6), fields),
                                      _mm512_maskz_permutexvar_epi8(even, pick(r, 5, 7), fields)};
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(nibbles[0], _mm512_loadu_si512(codes)), steps[0]);
#pragma GCC unroll 4
                for (int v = 1; v < 4; ++v) {
                    const __m512i pairs = _mm512_maddubs_epi16(nibbles[v], _mm512_loadu_si512(codes + 64 * v));
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, steps[v]));
                }
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(scaled[c][2 * r]), acc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; ++c) {
        _mm512_store_ps(least[c], mins[c]);
        for (int r = 0; r < R; ++r) _mm512_store_ps(part[r][c], acc[r][c]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // AVX2: a row's 16 lanes in two registers (lanes 0-7: each vector's first 32 codes, 8-15: its next 32)
    __m256 acc[R][C][2];
    __m128 mins[R][C];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
            mins[r][c] = _mm_setzero_ps();
        }
    }
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        for (int r = 0; r < R; ++r) {
            const unsigned char* block = rows[r] + b * BYTES;
            if (ahead) {
                const unsigned char* next = ahead[r] + b * BYTES;
                __builtin_prefetch(next);
                __builtin_prefetch(next + 64);
                __builtin_prefetch(next + 128);
            }
            alignas(8) uint8_t scales[8], mins_of[8];
            q4k_fields(block + 4, scales, mins_of);
            uint64_t packed;
            std::memcpy(&packed, mins_of, 8);
            const __m128i least = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(packed)));
            const float d = half(block), dmin = half(block + 2);
            __m256i nibbles[4][2];  // [vector][its half]: stretch 2h + half's low (v even) or high (v odd) nibbles
            for (int k = 0; k < 4; ++k) {
                const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + NIBBLES + 32 * k));
                nibbles[k / 2 * 2][k % 2] = _mm256_and_si256(bytes, low);
                nibbles[k / 2 * 2 + 1][k % 2] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
            if constexpr (FIVE) {  // each lane's fifth bit: 16 added where it is set
                const __m256i fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
                for (int v = 0; v < 4; ++v) {
                    for (int h = 0; h < 2; ++h) {
                        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << q5k_bit(v, 32 * h)));
                        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(fifth, bit), bit);
                        nibbles[v][h] = _mm256_add_epi8(nibbles[v][h], _mm256_and_si256(set, _mm256_set1_epi8(16)));
                    }
                }
            }
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int v = 0; v < 4; ++v) {
                    for (int h = 0; h < 2; ++h) {
                        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * v + 32 * h));
                        const __m256i step = _mm256_set1_epi16(scales[q4k_group(v, 8 * h)]);
                        sum[h] = _mm256_add_epi32(sum[h], _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles[v][h], x), step));
                    }
                }
                const float step = xs[c].steps[b];
                const __m256 scaled = _mm256_set1_ps(d * step);
                for (int h = 0; h < 2; ++h) acc[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[h]), scaled, acc[r][c][h]);
                const __m128i sums = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[c].sums + 8 * b));
                mins[r][c] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(least, sums)), _mm_set1_ps(dmin * step), mins[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            _mm256_store_ps(part[r][c], acc[r][c][0]);
            _mm256_store_ps(part[r][c] + 8, acc[r][c][1]);
            _mm_store_ps(least[c] + 4 * r, mins[r][c]);
        }
    }
#else
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) std::fill(part[r][c], part[r][c] + LANES, 0.0f);
    }
    for (int c = 0; c < C; ++c) std::fill(least[c], least[c] + 16, 0.0f);
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        for (int r = 0; r < R; ++r) {
            const unsigned char* block = rows[r] + b * BYTES;
            if (ahead) __builtin_prefetch(ahead[r] + b * BYTES);
            uint8_t scales[8], mins[8];
            q4k_fields(block + 4, scales, mins);
            const float d = half(block), dmin = half(block + 2);
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                const int16_t* sums = xs[c].sums + 8 * b;
                const float step = xs[c].steps[b];
                for (int lane = 0; lane < LANES; ++lane) {
                    int32_t sum = 0;
                    for (int v = 0; v < 4; ++v) {
                        int32_t own = 0;
                        for (int t = 4 * lane; t < 4 * lane + 4; ++t) {
                            const unsigned char byte = block[NIBBLES + 64 * (v / 2) + t];
                            int weight = (v % 2 ? byte >> 4 : byte) & 15;
                            if constexpr (FIVE) weight += (block[16 + t % 32] >> q5k_bit(v, t) & 1) << 4;
                            own += weight * codes[64 * v + t];
                        }
                        sum += scales[q4k_group(v, lane)] * own;
                    }
                    part[r][c][lane] = std::fma(static_cast<float>(sum), d * step, part[r][c][lane]);
                }
                for (int k = 0; k < 4; ++k) {
                    const int32_t pair = mins[2 * k] * sums[2 * k] + mins[2 * k + 1] * sums[2 * k + 1];
                    least[c][4 * r + k] = std::fma(static_cast<float>(pair), dmin * step, least[c][4 * r + k]);
                }
            }
        }
    }
#endif
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) out[r][c] = q4k_value(part[r][c], least[c] + 4 * r);
    }
}

// out[r][c] = rows[r] . xs[c] for R Q6_K rows of `cols` weights and C token vectors quantized for them; the R
// rows `ahead` (or null) prefetched meanwhile.
template <int R, int C>
inline void q6k_block(const unsigned char* const* rows, int64_t cols, const Quantized* xs, float (*out)[TILE],
                      const unsigned char* const* ahead) {
    alignas(64) float part[R][C][LANES];
#ifdef INT_DOT_AVX512
    __m512 acc[R][C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    const __m512i low = _mm512_set1_epi8(15), two_bits = _mm512_set1_epi8(3);
    // the bit pair of each byte of vector v (its first 32 bytes, then its next 32): 4 (v % 2) and 4 (v % 2) + 2
    const __m512i shifts[2] = {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1),
                               _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)};
    // vector v's int16 lane j is in group 4v + j / 8: its scale's index among the super-block's 16
    const __m512i groups = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(1), _mm_setzero_si128())),
        _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(2)), 1);
    for (int64_t b = 0; b < cols / QK_K; ++b) {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
            const unsigned char* block = rows[r] + b * Q6_K_BYTES;
            if (ahead) {
                const unsigned char* next = ahead[r] + b * Q6_K_BYTES;
                for (int line = 0; line < Q6_K_BYTES; line += 64) __builtin_prefetch(next + line);
            }
            const __m512i scales = _mm512_castsi256_si512(
                _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192))));
            __m512i q[4], steps[4];
#pragma GCC unroll 2
            for (int n = 0; n < 2; ++n) {
                const __m512i ql = _mm512_loadu_si512(block + 64 * n);
                const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * n));
                const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(high), high, 1);
#pragma GCC unroll 2
                for (int h = 0; h < 2; ++h) {
                    const __m512i nibbles = _mm512_and_si512(h ? _mm512_srli_epi16(ql, 4) : ql, low);
                    const __m512i bits = _mm512_and_si512(_mm512_srlv_epi16(qh, shifts[h]), two_bits);
                    q[2 * n + h] = _mm512_or_si512(nibbles, _mm512_slli_epi16(bits, 4));
                    steps[2 * n + h] =
                        _mm512_permutexvar_epi16(_mm512_add_epi16(groups, _mm512_set1_epi16(4 * (2 * n + h))), scales);
                }
            }
            const float d = half(block + 208);
#pragma GCC unroll 4
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                const int16_t* pairs = xs[c].pairs + b * (QK_K / 2);
                __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v) {
                    const __m512i products = _mm512_maddubs_epi16(q[v], _mm512_loadu_si512(codes + 64 * v));
                    const __m512i own = _mm512_sub_epi16(products, _mm512_loadu_si512(pairs + 32 * v));
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(own, steps[v]));
                }
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * xs[c].steps[b]), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) _mm512_store_ps(part[r][c], acc[r][c]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // AVX2: a row's 16 lanes in two registers (lanes 0-7: each vector's first 32 bytes, 8-15: its next 32)
    __m256 acc[R][C][2];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
    }
    const __m256i low = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        for (int r = 0; r < R; ++r) {
            const unsigned char* block = rows[r] + b * Q6_K_BYTES;
            if (ahead) {
                const unsigned char* next = ahead[r] + b * Q6_K_BYTES;
                for (int line = 0; line < Q6_K_BYTES; line += 64) __builtin_prefetch(next + line);
            }
            const int8_t* scale = reinterpret_cast<const int8_t*>(block + 192);
            __m256i q[4][2], steps[4][2];
            for (int v = 0; v < 4; ++v) {
                const int n = v / 2, h = v % 2;
                const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * n));
                for (int k = 0; k < 2; ++k) {
                    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * n + 32 * k));
                    const __m256i nibbles = _mm256_and_si256(h ? _mm256_srli_epi16(ql, 4) : ql, low);
                    const __m256i bits = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(4 * h + 2 * k)), two_bits);
                    q[v][k] = _mm256_or_si256(nibbles, _mm256_slli_epi16(bits, 4));
                    steps[v][k] = _mm256_set_m128i(_mm_set1_epi16(scale[4 * v + 2 * k + 1]), _mm_set1_epi16(scale[4 * v + 2 * k]));
                }
            }
            const float d = half(block + 208);
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                const int16_t* pairs = xs[c].pairs + b * (QK_K / 2);
                __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int v = 0; v < 4; ++v) {
                    for (int k = 0; k < 2; ++k) {
                        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * v + 32 * k));
                        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 32 * v + 16 * k));
                        const __m256i own = _mm256_sub_epi16(_mm256_maddubs_epi16(q[v][k], x), pair);
                        sum[k] = _mm256_add_epi32(sum[k], _mm256_madd_epi16(own, steps[v][k]));
                    }
                }
                const __m256 scaled = _mm256_set1_ps(d * xs[c].steps[b]);
                for (int k = 0; k < 2; ++k) acc[r][c][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k]), scaled, acc[r][c][k]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) {
            _mm256_store_ps(part[r][c], acc[r][c][0]);
            _mm256_store_ps(part[r][c] + 8, acc[r][c][1]);
        }
    }
#else
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) std::fill(part[r][c], part[r][c] + LANES, 0.0f);
    }
    for (int64_t b = 0; b < cols / QK_K; ++b) {
        for (int r = 0; r < R; ++r) {
            const unsigned char* block = rows[r] + b * Q6_K_BYTES;
            if (ahead) __builtin_prefetch(ahead[r] + b * Q6_K_BYTES);
            const int8_t* scale = reinterpret_cast<const int8_t*>(block + 192);
            const float d = half(block + 208);
            for (int c = 0; c < C; ++c) {
                const int8_t* codes = xs[c].codes + b * QK_K;
                for (int lane = 0; lane < LANES; ++lane) {
                    int32_t sum = 0;
                    for (int v = 0; v < 4; ++v) {
                        const int n = v / 2, h = v % 2;
                        int32_t own = 0;
                        for (int t = 4 * lane; t < 4 * lane + 4; ++t) {
                            const int nibble = block[64 * n + t] >> (4 * h) & 15;
                            const int bits = block[128 + 32 * n + t % 32] >> (4 * h + 2 * (t / 32)) & 3;
                            own += ((nibble | bits << 4) - 32) * codes[64 * v + t];
                        }
                        sum += scale[4 * v + lane / 4] * own;
                    }
                    part[r][c][lane] = std::fma(static_cast<float>(sum), d * xs[c].steps[b], part[r][c][lane]);
                }
            }
        }
    }
#endif
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < C; ++c) out[r][c] = lane_sum(part[r][c]);
    }
}

template <Kind K, int R>
inline void qk_tile(const unsigned char* const* rows, int64_t cols, const Quantized* xs, int count,
                    float (*out)[TILE], const unsigned char* const* ahead) {
    if constexpr (K == Kind::Q6_K) {
        switch (count) {
            case 1: q6k_block<R, 1>(rows, cols, xs, out, ahead); break;
            case 2: q6k_block<R, 2>(rows, cols, xs, out, ahead); break;
            case 3: q6k_block<R, 3>(rows, cols, xs, out, ahead); break;
            default: q6k_block<R, TILE>(rows, cols, xs, out, ahead); break;
        }
    } else {
        switch (count) {
            case 1: qk_block<K, R, 1>(rows, cols, xs, out, ahead); break;
            case 2: qk_block<K, R, 2>(rows, cols, xs, out, ahead); break;
            case 3: qk_block<K, R, 3>(rows, cols, xs, out, ahead); break;
            default: qk_block<K, R, TILE>(rows, cols, xs, out, ahead); break;
        }
    }
}

// out[r][c] = rows[r] . xs[c] for R rows of `kind` (Q4_K, Q5_K or Q6_K: `integer_kind`) and `count` (1 to TILE)
// token vectors quantized for them.
template <int R>
inline void qk_rows(Kind kind, const char* const* rows, int64_t cols, const Quantized* xs, int count,
                    float (*out)[TILE], const char* const* ahead = nullptr) {
    const auto* own = reinterpret_cast<const unsigned char* const*>(rows);
    const auto* next = reinterpret_cast<const unsigned char* const*>(ahead);
    if (kind == Kind::Q5_K) {
        qk_tile<Kind::Q5_K, R>(own, cols, xs, count, out, next);
    } else if (kind == Kind::Q6_K) {
        qk_tile<Kind::Q6_K, R>(own, cols, xs, count, out, next);
    } else {
        qk_tile<Kind::Q4_K, R>(own, cols, xs, count, out, next);
    }
}

}  // namespace dot
