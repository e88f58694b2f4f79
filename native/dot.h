// Dot products of weight rows with token vectors, fp32 arithmetic, for the native CPU kernels.
//
// Weights are fp32, bf16, int8 with one fp32 scale per row (weight = int8 * scale), or GGUF's Q8_0 (blocks of
// 32 weights: an fp16 scale, then 32 int8; weight = int8 * scale) or Q4_K (super-blocks of 256: fp16 d and
// dmin, eight 6-bit scales and mins, 4-bit q; weight = d * scale * q - dmin * min), widened to fp32 exactly
// as GGUF's own dequantizer does (every product is exact), read row by row from contiguous memory. A pass takes R weight rows and C token vectors at once (R * C sums kept in registers),
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
#include <type_traits>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dot {

enum class Kind : int { F32 = 0, BF16 = 1, I8 = 2, Q8_0 = 3, Q4_K = 4 };

constexpr int TILE = 4;    // token vectors per pass (C at most)
constexpr int LANES = 16;  // partial sums of one dot product: one AVX-512 register, two AVX2 ones
constexpr int64_t Q8_BLOCK = 32, Q8_BLOCK_BYTES = 34;  // Q8_0: weights a block, its bytes (fp16 + 32 int8)
constexpr int64_t Q4K_BLOCK = 256, Q4K_BLOCK_BYTES = 144;  // Q4_K: weights a super-block, its bytes

// The bytes of one weight row of `cols` columns.
inline int64_t row_bytes(Kind kind, int64_t cols) {
    switch (kind) {
        case Kind::F32: return 4 * cols;
        case Kind::BF16: return 2 * cols;
        case Kind::I8: return cols;
        case Kind::Q8_0:
            if (cols % Q8_BLOCK) throw std::invalid_argument("Q8_0 rows hold whole blocks of 32 weights");
            return cols / Q8_BLOCK * Q8_BLOCK_BYTES;
        case Kind::Q4_K:
            if (cols % Q4K_BLOCK) throw std::invalid_argument("Q4_K rows hold whole super-blocks of 256 weights");
            return cols / Q4K_BLOCK * Q4K_BLOCK_BYTES;
    }
    throw std::invalid_argument("unknown weight kind");
}

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

    void widen(int r, int64_t col, float* wide) const {
#pragma omp simd
        for (int l = 0; l < LANES; ++l) wide[l] = dot::widen(row[r][col + l]);
    }
    float one(int r, int64_t col) const { return dot::widen(row[r][col]); }
    const void* at(int r, int64_t col) const { return row[r] + col; }
};

// LANES (16) codes widened to fp32 in registers: int8 times a scale (Q8_0), or the nibble at `bits` (0 or 4)
// of 16 bytes times a step less a shift (Q4_K). The products are exact, so the fused form gives the bits of
// the plain one; where the compiler's own vectorisation of these loops stays with 16-byte vectors, the
// intrinsics widen 16 bytes to a whole register at once.
inline void widen_int8(const int8_t* q, float scale, float* wide) {
#if defined(__AVX512F__)
    const __m512i ints = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    _mm512_storeu_ps(wide, _mm512_mul_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(scale)));
#elif defined(__AVX2__)
    for (int h = 0; h < LANES; h += 8) {
        const __m256i ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h)));
        _mm256_storeu_ps(wide + h, _mm256_mul_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(scale)));
    }
#else
#pragma omp simd
    for (int l = 0; l < LANES; ++l) wide[l] = static_cast<float>(q[l]) * scale;
#endif
}

inline void widen_nibbles(const unsigned char* q, int bits, float step, float shift, float* wide) {
#if defined(__AVX512F__)
    __m512i ints = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    ints = _mm512_and_si512(_mm512_srl_epi32(ints, _mm_cvtsi32_si128(bits)), _mm512_set1_epi32(15));
    _mm512_storeu_ps(wide, _mm512_fmsub_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(step), _mm512_set1_ps(shift)));
#elif defined(__AVX2__) && defined(__FMA__)
    for (int h = 0; h < LANES; h += 8) {
        __m256i ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + h)));
        ints = _mm256_and_si256(_mm256_srl_epi32(ints, _mm_cvtsi32_si128(bits)), _mm256_set1_epi32(15));
        const __m256 v = _mm256_fmsub_ps(_mm256_cvtepi32_ps(ints), _mm256_set1_ps(step), _mm256_set1_ps(shift));
        _mm256_storeu_ps(wide + h, v);
    }
#else
#pragma omp simd
    for (int l = 0; l < LANES; ++l) wide[l] = static_cast<float>((q[l] >> bits) & 15) * step - shift;
#endif
}

// R Q8_0 rows: a block's weights widened with its scale (int8 * scale, in fp32), the values GGUF's own
// dequantizer gives, so a row sums as its dequantized fp32 copy does. Rows hold whole blocks, and LANES
// divides a block: a pass's weights share one scale.
template <int R>
struct Q8Blocks {
    const unsigned char* row[R];

    const unsigned char* block(int r, int64_t col) const { return row[r] + col / Q8_BLOCK * Q8_BLOCK_BYTES; }
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* b = block(r, col);
        const float scale = half(b);
        widen_int8(reinterpret_cast<const int8_t*>(b + 2 + col % Q8_BLOCK), scale, wide);
    }
    float one(int r, int64_t col) const {
        const unsigned char* b = block(r, col);
        return static_cast<float>(reinterpret_cast<const int8_t*>(b + 2)[col % Q8_BLOCK]) * half(b);
    }
    const void* at(int r, int64_t col) const { return block(r, col); }
};

// R Q4_K rows: a group of 32 weights widened with its super-block's d * scale and dmin * min (fp32; the
// products are exact, so these are GGUF's dequantized values). The group's 32 weights are the low nibbles (the
// first 32 of a 64-weight stretch) or the high nibbles (the next 32) of the stretch's 32 bytes; LANES divides a
// group, so a pass's weights share one scale and min.
template <int R>
struct Q4KBlocks {
    const unsigned char* row[R];

    const unsigned char* block(int r, int64_t col) const { return row[r] + col / Q4K_BLOCK * Q4K_BLOCK_BYTES; }
    // The step (d * scale) and shift (dmin * min) of group j (0..7) of super-block b.
    static void group(const unsigned char* b, int j, float& step, float& shift) {
        const unsigned char* p = b + 4;
        int scale, least;
        if (j < 4) {
            scale = p[j] & 63;
            least = p[j + 4] & 63;
        } else {
            scale = (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
            least = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
        }
        step = half(b) * static_cast<float>(scale);
        shift = half(b + 2) * static_cast<float>(least);
    }
    void widen(int r, int64_t col, float* wide) const {
        const unsigned char* b = block(r, col);
        const int in = static_cast<int>(col % Q4K_BLOCK), stretch = in / 64, high = (in % 64) / 32;
        float step, shift;
        group(b, 2 * stretch + high, step, shift);
        widen_nibbles(b + 16 + stretch * 32 + in % 32, 4 * high, step, shift, wide);
    }
    float one(int r, int64_t col) const {
        const unsigned char* b = block(r, col);
        const int in = static_cast<int>(col % Q4K_BLOCK), stretch = in / 64, high = (in % 64) / 32;
        float step, shift;
        group(b, 2 * stretch + high, step, shift);
        return static_cast<float>((b[16 + stretch * 32 + in % 32] >> (4 * high)) & 15) * step - shift;
    }
    const void* at(int r, int64_t col) const { return block(r, col); }
};

// out[r][c] = w[r] . xs[c] over `cols` columns, for R rows and C token vectors. With `ahead` (R rows of the
// next pass, or null) those rows are prefetched at the pace this pass reads its own: weights come from memory
// once per decode step, and short rows give the hardware's prefetcher no time to find the stream.
template <int R, int C, typename Rows>
inline void dot_block(const Rows& w, int64_t cols, const float* const* xs, float (*out)[TILE], const Rows* ahead) {
    float part[R][C][LANES] = {};
    const int64_t full = cols - cols % LANES;
    for (int64_t col = 0; col < full; col += LANES) {
        if (ahead) {
            for (int r = 0; r < R; ++r) __builtin_prefetch(ahead->at(r, col));
        }
        float wide[R][LANES];
        for (int r = 0; r < R; ++r) w.widen(r, col, wide[r]);
        for (int c = 0; c < C; ++c) {
            const float* x = xs[c] + col;
            for (int r = 0; r < R; ++r) {
#pragma omp simd
                for (int l = 0; l < LANES; ++l) part[r][c][l] += wide[r][l] * x[l];
            }
        }
    }
    for (int64_t col = full; col < cols; ++col) {
        for (int r = 0; r < R; ++r) {
            for (int c = 0; c < C; ++c) part[r][c][col - full] += w.one(r, col) * xs[c][col];
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

// Raw row pointers as a reader of R rows of its kind.
template <typename Rows, int R>
inline Rows reader(const char* const* rows) {
    Rows w;
    for (int r = 0; r < R; ++r) w.row[r] = reinterpret_cast<std::remove_reference_t<decltype(w.row[0])>>(rows[r]);
    return w;
}

template <int R, typename Rows>
inline void dot_as(const char* const* rows, int64_t cols, const float* const* xs, int count, float (*out)[TILE],
                   const char* const* ahead) {
    const Rows w = reader<Rows, R>(rows);
    Rows next;
    if (ahead) next = reader<Rows, R>(ahead);
    const Rows* prefetch = ahead ? &next : nullptr;
    switch (count) {
        case 1: dot_block<R, 1>(w, cols, xs, out, prefetch); break;
        case 2: dot_block<R, 2>(w, cols, xs, out, prefetch); break;
        case 3: dot_block<R, 3>(w, cols, xs, out, prefetch); break;
        default: dot_block<R, TILE>(w, cols, xs, out, prefetch); break;
    }
}

// out[r][c] = rows[r] . xs[c] for R weight rows of one kind (unscaled) and `count` (1 to TILE) token vectors,
// prefetching the R rows `ahead` (null: none) meanwhile.
template <int R>
inline void dot_rows(Kind kind, const char* const* rows, int64_t cols, const float* const* xs, int count,
                     float (*out)[TILE], const char* const* ahead = nullptr) {
    switch (kind) {
        case Kind::F32: return dot_as<R, Elements<R, float>>(rows, cols, xs, count, out, ahead);
        case Kind::BF16: return dot_as<R, Elements<R, uint16_t>>(rows, cols, xs, count, out, ahead);
        case Kind::I8: return dot_as<R, Elements<R, int8_t>>(rows, cols, xs, count, out, ahead);
        case Kind::Q8_0: return dot_as<R, Q8Blocks<R>>(rows, cols, xs, count, out, ahead);
        case Kind::Q4_K: return dot_as<R, Q4KBlocks<R>>(rows, cols, xs, count, out, ahead);
    }
    throw std::invalid_argument("unknown weight kind");
}

template <int R, typename Rows>
inline void widen_all(const char** rows, int64_t cols, float* buffer) {
    const Rows w = reader<Rows, R>(rows);
    const int64_t full = cols - cols % LANES;
    for (int r = 0; r < R; ++r) {
        float* wide = buffer + r * cols;
        for (int64_t col = 0; col < full; col += LANES) w.widen(r, col, wide + col);
        for (int64_t col = full; col < cols; ++col) wide[col] = w.one(r, col);
        rows[r] = reinterpret_cast<const char*>(wide);
    }
}

// Points `rows` (R rows of `kind`) at fp32 copies in `buffer` [R * cols] when more than one pass of TILE token
// vectors will read them, so that each weight is widened once rather than once a pass (exact: the same
// values); returns the kind the rows then have.
template <int R>
inline Kind widen_rows(Kind kind, const char** rows, int64_t cols, int64_t readers, float* buffer) {
    if (kind == Kind::F32 || readers <= TILE) return kind;
    switch (kind) {
        case Kind::BF16: widen_all<R, Elements<R, uint16_t>>(rows, cols, buffer); break;
        case Kind::I8: widen_all<R, Elements<R, int8_t>>(rows, cols, buffer); break;
        case Kind::Q8_0: widen_all<R, Q8Blocks<R>>(rows, cols, buffer); break;
        case Kind::Q4_K: widen_all<R, Q4KBlocks<R>>(rows, cols, buffer); break;
        default: throw std::invalid_argument("unknown weight kind");
    }
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
