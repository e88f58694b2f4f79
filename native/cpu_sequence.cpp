// The CPU backend set's sequence mixers over a whole flat batch, reading and writing the paged state in place:
//
//   paged_decode_attention  attention of each single-row sequence over its keys in the paged KV cache
//   conv_varlen             Gated DeltaNet's depthwise causal conv + SiLU, continuing each sequence's conv state
//   delta_rule_varlen       the gated delta rule token by token, continuing each sequence's recurrent state
//   qk_norm_rope            per-head RMSNorm of q and k, then rotary position embedding
//
// Everything is fp32. Each sequence (and head) is computed on its own, in a fixed order, so a row's result never
// depends on what else shares the batch. Work is split over sequences and heads between OpenMP threads; windows
// too small to pay for a thread team run on the calling thread. Every index read from the layout is checked
// before memory is touched. Wrappers, layout checks and torch references: app/kernels/cpu_sequence.py.

#include "dot.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int64_t MAX_HEAD_DIM = 1024;  // the longest head qk_norm_rope takes
constexpr int64_t SMALL_WORK = 16;  // units of work (rows times heads) below which one thread does it all

int team(int threads, int64_t units) { return units < SMALL_WORK ? 1 : std::max(1, threads); }

const int64_t* as_i64(uintptr_t p) { return reinterpret_cast<const int64_t*>(p); }
const int32_t* as_i32(uintptr_t p) { return reinterpret_cast<const int32_t*>(p); }

// The rows [start, end) of each sequence from query_start [seqs + 1], checked to be in order within [0, tokens].
void check_starts(const int32_t* query_start, int64_t seqs, int64_t tokens) {
    if (query_start[0] != 0 || query_start[seqs] > tokens) {
        throw pybind11::value_error("query_start must run from 0 to at most the batch's rows");
    }
    for (int64_t s = 0; s < seqs; ++s) {
        if (query_start[s + 1] < query_start[s]) throw pybind11::value_error("query_start must not decrease");
    }
}

void check_slots(const int64_t* slots, int64_t seqs, int64_t pool_slots, const char* what) {
    for (int64_t s = 0; s < seqs; ++s) {
        if (slots[s] < 0 || slots[s] >= pool_slots) {
            throw pybind11::value_error(std::string(what) + " must be in [0, " + std::to_string(pool_slots) + ")");
        }
    }
}

// Attention of the single row of each sequence whose span has one row (others are left to the caller) over
// the sequence's seq_lens[s] keys: block_table [seqs, width] maps positions to blocks of the caches
// [blocks, block_size, kv_heads, head_dim]; q and out [tokens, heads, head_dim] (q rows q_stride apart).
// The query heads of one kv head share each key read; softmax in two passes over the scores.
void paged_decode_attention(uintptr_t q_ptr, uintptr_t keys_ptr, uintptr_t values_ptr, uintptr_t out_ptr,
                            uintptr_t query_start_ptr, uintptr_t seq_lens_ptr, uintptr_t block_table_ptr,
                            int64_t seqs, int64_t tokens, int64_t width, int64_t blocks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride, double scale,
                            int threads) {
    const float* q = reinterpret_cast<const float*>(q_ptr);
    const float* keys = reinterpret_cast<const float*>(keys_ptr);
    const float* values = reinterpret_cast<const float*>(values_ptr);
    float* out = reinterpret_cast<float*>(out_ptr);
    const int32_t* query_start = as_i32(query_start_ptr);
    const int32_t* seq_lens = as_i32(seq_lens_ptr);
    const int32_t* table = as_i32(block_table_ptr);
    if (kv_heads < 1 || heads % kv_heads != 0) throw pybind11::value_error("heads must be a multiple of kv_heads");
    check_starts(query_start, seqs, tokens);
    std::vector<int64_t> single;  // the sequences this call computes
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; ++s) {
        if (query_start[s + 1] - query_start[s] != 1) continue;
        const int64_t length = seq_lens[s];
        if (length < 1 || length > width * block_size) {
            throw pybind11::value_error("seq_lens must be in [1, block_table width * block_size]");
        }
        for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
            const int32_t block = table[s * width + b];
            if (block < 0 || block >= blocks) {
                throw pybind11::value_error("block_table entries must be in [0, " + std::to_string(blocks) + ")");
            }
        }
        single.push_back(s);
        longest = std::max(longest, length);
    }
    const int64_t group = heads / kv_heads, count = static_cast<int64_t>(single.size());
    const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
    const float fscale = static_cast<float>(scale);
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(team(threads, count * kv_heads * longest / 64))
    {
        std::vector<float> scores(static_cast<size_t>(group * longest));
        std::vector<float> acc(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < count * kv_heads; ++unit) {
            const int64_t s = single[unit / kv_heads], kv = unit % kv_heads, row = query_start[s];
            const int64_t length = seq_lens[s];
            const int32_t* blocks_of = table + s * width;
            // key j sits at offset j % block_size of block blocks_of[j / block_size]: walked block by block
            for (int64_t first = 0; first < length; first += block_size) {
                const float* block = keys + blocks_of[first / block_size] * block_stride + kv * head_dim;
                const int64_t here = std::min(block_size, length - first);
                for (int64_t o = 0; o < here; ++o) {
                    const char* key[1] = {reinterpret_cast<const char*>(block + o * token_stride)};
                    for (int64_t g0 = 0; g0 < group; g0 += dot::TILE) {
                        const int count = static_cast<int>(std::min<int64_t>(dot::TILE, group - g0));
                        const float* xs[dot::TILE];
                        for (int c = 0; c < count; ++c) xs[c] = q + row * q_stride + (kv * group + g0 + c) * head_dim;
                        float out[1][dot::TILE];
                        dot::dot_rows<1>(dot::Kind::F32, key, head_dim, xs, count, out);
                        for (int c = 0; c < count; ++c) scores[(g0 + c) * longest + first + o] = out[0][c] * fscale;
                    }
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                float* p = &scores[g * longest];
                float most = p[0];
                for (int64_t j = 1; j < length; ++j) most = std::max(most, p[j]);
                float total = 0.0f;
                #pragma omp simd reduction(+ : total)
                for (int64_t j = 0; j < length; ++j) total += (p[j] = dot::exp(p[j] - most));
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t first = 0; first < length; first += block_size) {
                    const float* block = values + blocks_of[first / block_size] * block_stride + kv * head_dim;
                    const int64_t here = std::min(block_size, length - first);
                    for (int64_t o = 0; o < here; ++o) {
                        const float* value = block + o * token_stride;
                        const float w = p[first + o];
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * value[d];
                    }
                }
                float* o = out + row * heads * head_dim + (kv * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] / total;
            }
        }
    }
}

// SiLU of the depthwise causal conv of every sequence: x [tokens, channels] (rows x_stride apart), weight
// [channels, kernel]; conv_state [pool_slots, channels, kernel - 1], each sequence's slot read, then
// overwritten with its last kernel - 1 inputs; out [tokens, channels]. Taps added in order, as the reference.
void conv_varlen(uintptr_t x_ptr, uintptr_t weight_ptr, uintptr_t state_ptr, uintptr_t out_ptr,
                 uintptr_t query_start_ptr, uintptr_t slots_ptr, int64_t seqs, int64_t tokens, int64_t channels,
                 int64_t kernel, int64_t x_stride, int64_t pool_slots, int threads) {
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const float* weight = reinterpret_cast<const float*>(weight_ptr);
    float* state = reinterpret_cast<float*>(state_ptr);
    float* out = reinterpret_cast<float*>(out_ptr);
    const int32_t* query_start = as_i32(query_start_ptr);
    const int64_t* slots = as_i64(slots_ptr);
    if (kernel < 2 || kernel > 16) throw pybind11::value_error("the conv kernel must have 2 to 16 taps");
    check_starts(query_start, seqs, tokens);
    check_slots(slots, seqs, pool_slots, "state_slots");
    const int64_t keep = kernel - 1;
    pybind11::gil_scoped_release release;
#pragma omp parallel for collapse(2) schedule(static) num_threads(team(threads, query_start[seqs] * channels / 256))
    for (int64_t s = 0; s < seqs; ++s) {
        for (int64_t c = 0; c < channels; ++c) {
            float window[16];  // the last kernel - 1 inputs, oldest first
            float* held = state + (slots[s] * channels + c) * keep;
            std::memcpy(window, held, keep * sizeof(float));
            const float* w = weight + c * kernel;
            for (int64_t t = query_start[s]; t < query_start[s + 1]; ++t) {
                const float input = x[t * x_stride + c];
                float acc = window[0] * w[0];
                for (int64_t j = 1; j < keep; ++j) acc = acc + window[j] * w[j];
                acc = acc + input * w[keep];
                out[t * channels + c] = dot::silu(acc);
                for (int64_t j = 0; j + 1 < keep; ++j) window[j] = window[j + 1];
                window[keep - 1] = input;
            }
            std::memcpy(held, window, keep * sizeof(float));
        }
    }
}

// The gated delta rule of every sequence, token by token, each (sequence, value head) on one thread with its
// [dk, dv] state: q, k [tokens, k_heads, dk] raw (l2-normalised here, q also scaled), v [tokens, v_heads, dv]
// (rows of each *_stride apart, heads dk / dv apart), g (log decay) and beta [tokens, v_heads] (rows g_stride /
// beta_stride apart); state [pool_slots, v_heads, dk, dv]; out [tokens, v_heads, dv]. With save_at / save_slots
// (nonzero pointers) a sequence also leaves its state after save_at[s] positions (0: none) in slot save_slots[s].
void delta_rule_varlen(uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t v_ptr, uintptr_t g_ptr, uintptr_t beta_ptr,
                       uintptr_t state_ptr, uintptr_t out_ptr, uintptr_t query_start_ptr, uintptr_t seq_lens_ptr,
                       uintptr_t slots_ptr, uintptr_t save_at_ptr, uintptr_t save_slots_ptr, int64_t seqs,
                       int64_t tokens, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t q_stride,
                       int64_t k_stride, int64_t v_stride, int64_t g_stride, int64_t beta_stride, int64_t pool_slots,
                       double scale, double eps, int threads) {
    const float* q = reinterpret_cast<const float*>(q_ptr);
    const float* k = reinterpret_cast<const float*>(k_ptr);
    const float* v = reinterpret_cast<const float*>(v_ptr);
    const float* g = reinterpret_cast<const float*>(g_ptr);
    const float* beta = reinterpret_cast<const float*>(beta_ptr);
    float* state = reinterpret_cast<float*>(state_ptr);
    float* out = reinterpret_cast<float*>(out_ptr);
    const int32_t* query_start = as_i32(query_start_ptr);
    const int32_t* seq_lens = as_i32(seq_lens_ptr);
    const int64_t* slots = as_i64(slots_ptr);
    const int32_t* save_at = save_at_ptr ? as_i32(save_at_ptr) : nullptr;
    const int64_t* save_slots = save_slots_ptr ? as_i64(save_slots_ptr) : nullptr;
    if (k_heads < 1 || v_heads % k_heads != 0) throw pybind11::value_error("v_heads must be a multiple of k_heads");
    check_starts(query_start, seqs, tokens);
    check_slots(slots, seqs, pool_slots, "state_slots");
    for (int64_t s = 0; s < seqs && save_at; ++s) {
        if (save_at[s] > 0) check_slots(save_slots + s, 1, pool_slots, "save_slots");
    }
    const int64_t ratio = v_heads / k_heads, head_state = dk * dv;
    const float fscale = static_cast<float>(scale), feps = static_cast<float>(eps);
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(team(threads, query_start[seqs] * v_heads))
    {
        std::vector<float> qn(static_cast<size_t>(dk)), kn(static_cast<size_t>(dk));
        std::vector<float> predicted(static_cast<size_t>(dv)), delta(static_cast<size_t>(dv));
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < seqs; ++s) {
            for (int64_t h = 0; h < v_heads; ++h) {
                const int64_t start = query_start[s], end = query_start[s + 1], kh = h / ratio;
                const int64_t past = seq_lens[s] - (end - start);
                float* S = state + (slots[s] * v_heads + h) * head_state;
                for (int64_t t = start; t < end; ++t) {
                    const float* qt = q + t * q_stride + kh * dk;
                    const float* kt = k + t * k_stride + kh * dk;
                    const float* vt = v + t * v_stride + h * dv;
                    float qq = 0.0f, kk = 0.0f;
                    for (int64_t i = 0; i < dk; ++i) {
                        qq += qt[i] * qt[i];
                        kk += kt[i] * kt[i];
                    }
                    const float qs = fscale / std::sqrt(qq + feps), ks = 1.0f / std::sqrt(kk + feps);
                    for (int64_t i = 0; i < dk; ++i) {
                        qn[i] = qt[i] * qs;
                        kn[i] = kt[i] * ks;
                    }
                    const float decay = dot::exp(g[t * g_stride + h]), b = beta[t * beta_stride + h];
                    std::fill(predicted.begin(), predicted.end(), 0.0f);
                    for (int64_t i = 0; i < dk; ++i) {
                        float* row = S + i * dv;
                        const float ki = kn[i];
#pragma omp simd
                        for (int64_t j = 0; j < dv; ++j) {
                            row[j] *= decay;
                            predicted[j] += ki * row[j];
                        }
                    }
                    for (int64_t j = 0; j < dv; ++j) delta[j] = (vt[j] - predicted[j]) * b;
                    float* o = out + (t * v_heads + h) * dv;
                    std::fill(o, o + dv, 0.0f);
                    for (int64_t i = 0; i < dk; ++i) {
                        float* row = S + i * dv;
                        const float ki = kn[i], qi = qn[i];
#pragma omp simd
                        for (int64_t j = 0; j < dv; ++j) {
                            row[j] += ki * delta[j];
                            o[j] += qi * row[j];
                        }
                    }
                    if (save_at && save_at[s] > 0 && past + (t - start) + 1 == save_at[s]) {
                        std::memcpy(state + (save_slots[s] * v_heads + h) * head_state, S, head_state * sizeof(float));
                    }
                }
            }
        }
    }
}

// RMSNorm of each head of q [tokens, q_heads, dim] and k [tokens, k_heads, dim] (rows q_stride / k_stride
// apart) with its weight (times 1 + weight with `offset`), then neox rotary over the first rotary dims with
// cos, sin [tokens, rotary]; into q_out [tokens, q_heads, dim] and k_out [tokens, k_heads, dim].
void qk_norm_rope(uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t q_weight_ptr, uintptr_t k_weight_ptr,
                  uintptr_t cos_ptr, uintptr_t sin_ptr, uintptr_t q_out_ptr, uintptr_t k_out_ptr, int64_t tokens,
                  int64_t q_heads, int64_t k_heads, int64_t dim, int64_t rotary, int64_t q_stride, int64_t k_stride,
                  double eps, bool offset, int threads) {
    if (rotary % 2 != 0 || rotary > dim) throw pybind11::value_error("rotary dims must be even and at most dim");
    if (dim > MAX_HEAD_DIM) throw pybind11::value_error("head_dim must be at most " + std::to_string(MAX_HEAD_DIM));
    const float* cos = reinterpret_cast<const float*>(cos_ptr);
    const float* sin = reinterpret_cast<const float*>(sin_ptr);
    const float feps = static_cast<float>(eps);
    const int64_t heads = q_heads + k_heads, half = rotary / 2;
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(team(threads, tokens * heads / 8))
    for (int64_t unit = 0; unit < tokens * heads; ++unit) {
        const int64_t t = unit / heads, h = unit % heads;
        const bool is_q = h < q_heads;
        const float* in = reinterpret_cast<const float*>(is_q ? q_ptr : k_ptr) + t * (is_q ? q_stride : k_stride) +
                          (is_q ? h : h - q_heads) * dim;
        const float* weight = reinterpret_cast<const float*>(is_q ? q_weight_ptr : k_weight_ptr);
        float* o = reinterpret_cast<float*>(is_q ? q_out_ptr : k_out_ptr) +
                   (t * (is_q ? q_heads : k_heads) + (is_q ? h : h - q_heads)) * dim;
        float squares = 0.0f;
        for (int64_t d = 0; d < dim; ++d) squares += in[d] * in[d];
        const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(dim) + feps);
        float normed[MAX_HEAD_DIM];
        for (int64_t d = 0; d < dim; ++d) {
            const float n = in[d] * rstd;
            normed[d] = offset ? n * (1.0f + weight[d]) : weight[d] * n;
        }
        const float* c = cos + t * rotary;
        const float* s = sin + t * rotary;
        for (int64_t d = 0; d < half; ++d) {
            o[d] = normed[d] * c[d] + -normed[d + half] * s[d];
            o[d + half] = normed[d + half] * c[d + half] + normed[d] * s[d + half];
        }
        for (int64_t d = rotary; d < dim; ++d) o[d] = normed[d];
    }
}

}  // namespace

void register_sequence_kernels(pybind11::module_& m) {
    m.def("paged_decode_attention", &paged_decode_attention,
          "attention of single-row sequences over the paged KV cache; raw pointers, see cpu_sequence.py");
    m.def("conv_varlen", &conv_varlen, "Gated DeltaNet's causal conv + SiLU; raw pointers, see cpu_sequence.py");
    m.def("delta_rule_varlen", &delta_rule_varlen,
          "the gated delta rule token by token; raw pointers, see cpu_sequence.py");
    m.def("qk_norm_rope", &qk_norm_rope, "per-head RMSNorm and rotary of q, k; raw pointers, see cpu_sequence.py");
}
