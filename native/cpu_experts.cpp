// The CPU expert pool's kernel: routed experts' SwiGLU over the rows routed to each, from host RAM.
//
//   h[t, j] = silu(gate_j . x_t) * (up_j . x_t)      j < I   (gate_up rows j and I + j)
//   y[t, i] = down_i . h_t                            i < H
//
// x [n, H] and y [n, H] are fp32; the weights are fp32, bf16 or int8 with one fp32 scale per output row
// (weight = int8 * scale). Work is split over output rows between threads (OpenMP); each dot product runs over
// contiguous memory in fp32, four tokens per pass over a weight row, so the compiler vectorises it for the
// machine it is built on (-march=native).
// Bound with pybind11; called from app/kernels/cpu_experts.py, which checks shapes, dtypes and contiguity and
// passes raw pointers.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

enum class Kind : int { F32 = 0, BF16 = 1, I8 = 2 };

inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

constexpr int TILE = 4;  // tokens whose dot products share one pass over a weight row

// Dot products of one weight row (length `cols`, converted to fp32 by `load`) with TILE token vectors at once,
// so each weight is read and converted once per tile. acc[k] gets row . xs[k]. With `invariant` a lone row
// takes the same tile pass as a full tile (padded), so its result does not depend on how many rows came.
template <typename Load>
inline void dot_tile(Load load, int64_t cols, const float* const* xs, int count, bool invariant, float* acc) {
    if (count == 1 && !invariant) {  // a decode row alone: one dot product, no padding work
        const float* x0 = xs[0];
        float a0 = 0.0f;
#pragma omp simd reduction(+ : a0)
        for (int64_t c = 0; c < cols; ++c) a0 += load(c) * x0[c];
        acc[0] = a0;
        return;
    }
    const float* x0 = xs[0];
    const float* x1 = xs[1];
    const float* x2 = xs[2];
    const float* x3 = xs[3];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t c = 0; c < cols; ++c) {
        const float w = load(c);
        a0 += w * x0[c];
        a1 += w * x1[c];
        a2 += w * x2[c];
        a3 += w * x3[c];
    }
    acc[0] = a0;
    acc[1] = a1;
    acc[2] = a2;
    acc[3] = a3;
}

// One weight row dotted with `count` (up to TILE) token vectors (`xs` padded by repeating its first), in fp32.
inline void dot_row(const void* weights, Kind kind, int64_t row, int64_t cols, const float* scales,
                    const float* const* xs, int count, bool invariant, float* acc) {
    switch (kind) {
        case Kind::F32: {
            const float* w = static_cast<const float*>(weights) + row * cols;
            dot_tile([w](int64_t c) { return w[c]; }, cols, xs, count, invariant, acc);
            return;
        }
        case Kind::BF16: {
            const uint16_t* w = static_cast<const uint16_t*>(weights) + row * cols;
            dot_tile([w](int64_t c) { return bf16_to_f32(w[c]); }, cols, xs, count, invariant, acc);
            return;
        }
        case Kind::I8: {
            const int8_t* w = static_cast<const int8_t*>(weights) + row * cols;
            dot_tile([w](int64_t c) { return static_cast<float>(w[c]); }, cols, xs, count, invariant, acc);
            for (int k = 0; k < count; ++k) acc[k] *= scales[row];
            return;
        }
    }
    throw std::invalid_argument("unknown weight kind");
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// y [n, hidden] = SwiGLU of x [n, hidden] through one expert: gate_up [2 * inter, hidden], down [hidden, inter];
// h [n * inter] is scratch. Called by every thread of an OpenMP team (each `omp for` splits its output rows
// between them and ends in a barrier), or by one thread alone.
void swiglu_team(const float* x, const void* gate_up, const void* down, float* y, float* h,
                 const float* gate_up_scales, const float* down_scales, int64_t n, int64_t hidden, int64_t inter,
                 Kind kind, bool invariant) {
    for (int64_t first = 0; first < n; first += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, n - first));
        const float* xs[TILE];
        for (int k = 0; k < TILE; ++k) xs[k] = x + (first + (k < count ? k : 0)) * hidden;
#pragma omp for schedule(static)
        for (int64_t j = 0; j < inter; ++j) {
            float gate[TILE], up[TILE];
            dot_row(gate_up, kind, j, hidden, gate_up_scales, xs, count, invariant, gate);
            dot_row(gate_up, kind, inter + j, hidden, gate_up_scales, xs, count, invariant, up);
            for (int k = 0; k < count; ++k) h[(first + k) * inter + j] = silu(gate[k]) * up[k];
        }
    }
    for (int64_t first = 0; first < n; first += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, n - first));
        const float* hs[TILE];
        for (int k = 0; k < TILE; ++k) hs[k] = h + (first + (k < count ? k : 0)) * inter;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < hidden; ++i) {
            float acc[TILE];
            dot_row(down, kind, i, inter, down_scales, hs, count, invariant, acc);
            for (int k = 0; k < count; ++k) y[(first + k) * hidden + i] = acc[k];
        }
    }
}

int64_t element_bytes(Kind kind) {
    switch (kind) {
        case Kind::F32: return 4;
        case Kind::BF16: return 2;
        case Kind::I8: return 1;
    }
    throw std::invalid_argument("unknown weight kind");
}

Kind checked_kind(int kind_code, uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr) {
    const auto kind = static_cast<Kind>(kind_code);
    element_bytes(kind);
    if (kind == Kind::I8 && (gate_up_scales_ptr == 0 || down_scales_ptr == 0)) {
        throw std::invalid_argument("int8 weights need their scales");
    }
    return kind;
}

// y [n, hidden] = SwiGLU of x [n, hidden] through one expert.
void expert_swiglu(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr,
                   uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr, int64_t n, int64_t hidden,
                   int64_t inter, int kind_code, int threads) {
    const Kind kind = checked_kind(kind_code, gate_up_scales_ptr, down_scales_ptr);
    pybind11::gil_scoped_release release;
    std::vector<float> h(static_cast<size_t>(n * inter));
#pragma omp parallel num_threads(threads)
    swiglu_team(reinterpret_cast<const float*>(x_ptr), reinterpret_cast<const void*>(gate_up_ptr),
                reinterpret_cast<const void*>(down_ptr), reinterpret_cast<float*>(y_ptr), h.data(),
                reinterpret_cast<const float*>(gate_up_scales_ptr), reinterpret_cast<const float*>(down_scales_ptr),
                n, hidden, inter, kind, false);
}

// y [n, hidden] += the weighted SwiGLU of several experts of one layer, each over the rows routed to it:
// expert experts[e] (an index into gate_up [E, 2 * inter, hidden] / down [E, hidden, inter], and their scales
// [E, rows]) takes entries offsets[e] .. offsets[e + 1] of rows / weights. One call for a window's CPU share.
// Every index is checked against n (rows of x and y), total (experts in gate_up / down) and entries (the
// length of rows / weights) before any memory is read. With `invariant` each row's result is the same whatever
// other rows share its experts (see dot_tile).
void experts_swiglu_sum(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr,
                        uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr, int64_t hidden, int64_t inter,
                        int kind_code, int threads, uintptr_t experts_ptr, uintptr_t offsets_ptr,
                        uintptr_t rows_ptr, uintptr_t weights_ptr, int64_t count, int64_t n, int64_t total,
                        int64_t entries, bool invariant) {
    const Kind kind = checked_kind(kind_code, gate_up_scales_ptr, down_scales_ptr);
    const float* x = reinterpret_cast<const float*>(x_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    const auto* experts = reinterpret_cast<const int64_t*>(experts_ptr);
    const auto* offsets = reinterpret_cast<const int64_t*>(offsets_ptr);
    const auto* rows = reinterpret_cast<const int64_t*>(rows_ptr);
    const auto* weights = reinterpret_cast<const float*>(weights_ptr);
    const auto* gate_up = reinterpret_cast<const char*>(gate_up_ptr);
    const auto* down = reinterpret_cast<const char*>(down_ptr);
    const auto* gate_up_scales = reinterpret_cast<const float*>(gate_up_scales_ptr);
    const auto* down_scales = reinterpret_cast<const float*>(down_scales_ptr);
    const int64_t gate_up_size = 2 * inter * hidden, down_size = hidden * inter;
    if (offsets[0] != 0 || offsets[count] != entries) {
        throw pybind11::value_error("offsets must bound each expert's entries of rows and weights");
    }
    for (int64_t e = 0; e < count; ++e) {
        if (experts[e] < 0 || experts[e] >= total) {
            throw pybind11::value_error("experts must be in [0, " + std::to_string(total) + ")");
        }
        if (offsets[e + 1] < offsets[e]) {
            throw pybind11::value_error("offsets must bound each expert's entries of rows and weights");
        }
    }
    for (int64_t k = 0; k < entries; ++k) {
        if (rows[k] < 0 || rows[k] >= n) throw pybind11::value_error("rows must be in [0, " + std::to_string(n) + ")");
    }
    pybind11::gil_scoped_release release;
    int64_t most = 0;  // the most entries an expert has
    for (int64_t e = 0; e < count; ++e) most = std::max(most, offsets[e + 1] - offsets[e]);
    std::vector<float> xs(static_cast<size_t>(most * hidden)), ys(static_cast<size_t>(most * hidden));
    std::vector<float> h(static_cast<size_t>(most * inter));
    constexpr int64_t COLUMNS = 64;  // columns of y a thread adds at a time
    const int64_t blocks = (hidden + COLUMNS - 1) / COLUMNS;
    // One team for the whole call: the experts one after another, each one's rows split between the threads.
#pragma omp parallel num_threads(threads)
    for (int64_t e = 0; e < count; ++e) {
        const int64_t first = offsets[e], m = offsets[e + 1] - first, expert = experts[e];
#pragma omp for schedule(static)
        for (int64_t k = 0; k < m; ++k) std::memcpy(&xs[k * hidden], x + rows[first + k] * hidden, hidden * 4);
        swiglu_team(xs.data(), gate_up + expert * gate_up_size * element_bytes(kind),
                    down + expert * down_size * element_bytes(kind), ys.data(), h.data(),
                    gate_up_scales ? gate_up_scales + expert * 2 * inter : nullptr,
                    down_scales ? down_scales + expert * hidden : nullptr, m, hidden, inter, kind, invariant);
        // y += weight * result at each entry's row, a block of columns per thread (entries in order within it)
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t low = b * COLUMNS, high = std::min(hidden, low + COLUMNS);
            for (int64_t k = 0; k < m; ++k) {
                float* out = y + rows[first + k] * hidden;
                const float w = weights[first + k];
                const float* in = &ys[k * hidden];
                for (int64_t i = low; i < high; ++i) out[i] += w * in[i];
            }
        }
    }
}

// y [n, out] = x [n, in] @ weight [out, in]^T (+ bias [out]), fp32 results: the dense projections of a few
// rows (decode), each weight row read once per tile of TILE rows, output rows split between threads.
void dense(uintptr_t x_ptr, uintptr_t weight_ptr, uintptr_t bias_ptr, uintptr_t y_ptr, int64_t n, int64_t in,
           int64_t out, int kind_code, int threads, bool invariant) {
    const auto kind = static_cast<Kind>(kind_code);
    if (kind != Kind::F32 && kind != Kind::BF16) {
        throw pybind11::value_error("dense projections take fp32 or bf16 weights");
    }
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const void* weight = reinterpret_cast<const void*>(weight_ptr);
    const float* bias = reinterpret_cast<const float*>(bias_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < out; ++j) {
        for (int64_t first = 0; first < n; first += TILE) {
            const int count = static_cast<int>(std::min<int64_t>(TILE, n - first));
            const float* xs[TILE];
            for (int k = 0; k < TILE; ++k) xs[k] = x + (first + (k < count ? k : 0)) * in;
            float acc[TILE];
            dot_row(weight, kind, j, in, nullptr, xs, count, invariant, acc);
            for (int k = 0; k < count; ++k) y[(first + k) * out + j] = bias ? acc[k] + bias[j] : acc[k];
        }
    }
}

// RMSNorm of each row of x [rows, dim] (fp32) into y: x * rsqrt(mean(x^2) + eps), times weight, or times
// (1 + weight) with `offset`; with `residual` the row is residual + x, written to residual_out first; with
// `gate` the result is multiplied by silu(gate) (Gated DeltaNet's norm). Rows split between threads.
void rms_norm(uintptr_t x_ptr, uintptr_t residual_ptr, uintptr_t gate_ptr, uintptr_t weight_ptr, uintptr_t y_ptr,
              uintptr_t residual_out_ptr, int64_t rows, int64_t dim, double eps, bool offset, int threads) {
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const float* residual = reinterpret_cast<const float*>(residual_ptr);
    const float* gate = reinterpret_cast<const float*>(gate_ptr);
    const float* weight = reinterpret_cast<const float*>(weight_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    float* residual_out = reinterpret_cast<float*>(residual_out_ptr);
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(rows > 1 ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float* in = x + r * dim;
        if (residual) {
            float* sum = residual_out + r * dim;
            for (int64_t i = 0; i < dim; ++i) sum[i] = residual[r * dim + i] + in[i];
            in = sum;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; ++i) squares += in[i] * in[i];
        const float scale = 1.0f / std::sqrt(squares / static_cast<float>(dim) + static_cast<float>(eps));
        float* out = y + r * dim;
        for (int64_t i = 0; i < dim; ++i) {
            const float normed = in[i] * scale;
            float value = offset ? normed * (1.0f + weight[i]) : weight[i] * normed;
            if (gate) value *= silu(gate[r * dim + i]);
            out[i] = value;
        }
    }
}

// The router's picks for each row of logits [rows, experts] (fp32): softmax over all experts, the top_k
// (ties to the lower expert), their probabilities (renormalised to sum 1 with `renormalize`) into ids /
// weights [rows, top_k], each pick added to counts [experts] (by live[row], 0 on padding rows, when given).
void route(uintptr_t logits_ptr, uintptr_t ids_ptr, uintptr_t weights_ptr, uintptr_t counts_ptr,
           uintptr_t live_ptr, int64_t rows, int64_t experts, int64_t top_k, bool renormalize) {
    const float* logits = reinterpret_cast<const float*>(logits_ptr);
    auto* ids = reinterpret_cast<int64_t*>(ids_ptr);
    float* weights = reinterpret_cast<float*>(weights_ptr);
    auto* counts = reinterpret_cast<int64_t*>(counts_ptr);
    const auto* live = reinterpret_cast<const int64_t*>(live_ptr);
    if (top_k < 1 || top_k > experts) throw pybind11::value_error("top_k must be in [1, experts]");
    std::vector<float> p(static_cast<size_t>(experts));
    std::vector<char> taken(static_cast<size_t>(experts));
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = logits + r * experts;
        float most = row[0];
        for (int64_t e = 1; e < experts; ++e) most = std::max(most, row[e]);
        float total = 0.0f;
        for (int64_t e = 0; e < experts; ++e) total += (p[e] = std::exp(row[e] - most));
        for (int64_t e = 0; e < experts; ++e) p[e] /= total;
        std::fill(taken.begin(), taken.end(), 0);
        float picked = 0.0f;
        for (int64_t k = 0; k < top_k; ++k) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; ++e) {
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            }
            taken[best] = 1;
            ids[r * top_k + k] = best;
            weights[r * top_k + k] = p[best];
            picked += p[best];
            counts[best] += live ? live[r] : 1;
        }
        if (renormalize) {
            for (int64_t k = 0; k < top_k; ++k) weights[r * top_k + k] /= picked;
        }
    }
}

}  // namespace

PYBIND11_MODULE(_cpu_experts, m) {
    m.doc() = "The CPU expert pool's SwiGLU kernel (fp32, bf16 and int8 weights).";
    m.def("expert_swiglu", &expert_swiglu, "y = SwiGLU(x) through one expert; raw pointers, see cpu_experts.py");
    m.def("experts_swiglu_sum", &experts_swiglu_sum,
          "y += weighted SwiGLU of several experts over their rows; raw pointers, see cpu_experts.py");
    m.def("dense", &dense, "y = x @ weight.T (+ bias) for a few rows; raw pointers, see cpu_experts.py");
    m.def("route", &route, "softmax, top-k and counts of router logits; raw pointers, see cpu_experts.py");
    m.def("rms_norm", &rms_norm, "RMSNorm of rows (after a residual add, or gated); raw pointers, see cpu_experts.py");
}
