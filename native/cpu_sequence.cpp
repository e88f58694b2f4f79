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

// A paged KV cache: keys and values [blocks, block_size, kv_heads, head_dim] fp32, and each sequence's block
// table (rows of `width` block indices, int32).
struct PagedKV {
    const float* keys;
    const float* values;
    const int32_t* table;
    int64_t width, blocks, block_size, kv_heads, head_dim;

    int64_t token_stride() const { return kv_heads * head_dim; }
    int64_t block_stride() const { return block_size * kv_heads * head_dim; }

    // Refuses a sequence of `length` keys whose table row `s` points outside the cache.
    void check(int64_t s, int64_t length) const {
        if (length < 1 || length > width * block_size) {
            throw pybind11::value_error("seq_lens must be in [1, block_table width * block_size]");
        }
        for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
            const int32_t block = table[s * width + b];
            if (block < 0 || block >= blocks) {
                throw pybind11::value_error("block_table entries must be in [0, " + std::to_string(blocks) + ")");
            }
        }
    }
};

// Attention of `group` query heads (q, out: head_dim apart) sharing kv head `kv` over the first `length` keys
// of sequence `s`: scores through native/dot.h (each key read once for the group), softmax in two passes.
// scores [group * length] and acc [head_dim]: scratch.
void attend(const PagedKV& kv_cache, int64_t s, int64_t kv, int64_t length, const float* q, int64_t group,
            float scale, float* out, float* scores, float* acc) {
    const int64_t head_dim = kv_cache.head_dim, token_stride = kv_cache.token_stride();
    const int32_t* blocks_of = kv_cache.table + s * kv_cache.width;
    // key j sits at offset j % block_size of block blocks_of[j / block_size]: walked block by block
    for (int64_t first = 0; first < length; first += kv_cache.block_size) {
        const float* block = kv_cache.keys + blocks_of[first / kv_cache.block_size] * kv_cache.block_stride() +
                             kv * head_dim;
        const int64_t here = std::min(kv_cache.block_size, length - first);
        for (int64_t o = 0; o < here; ++o) {
            const char* key[1] = {reinterpret_cast<const char*>(block + o * token_stride)};
            for (int64_t g0 = 0; g0 < group; g0 += dot::TILE) {
                const int count = static_cast<int>(std::min<int64_t>(dot::TILE, group - g0));
                const float* xs[dot::TILE];
                for (int c = 0; c < count; ++c) xs[c] = q + (g0 + c) * head_dim;
                float dots[1][dot::TILE];
                dot::dot_rows<1>(dot::Kind::F32, key, head_dim, xs, count, dots);
                for (int c = 0; c < count; ++c) scores[(g0 + c) * length + first + o] = dots[0][c] * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float* p = scores + g * length;
        float most = p[0];
        for (int64_t j = 1; j < length; ++j) most = std::max(most, p[j]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < length; ++j) total += (p[j] = dot::exp(p[j] - most));
        std::fill(acc, acc + head_dim, 0.0f);
        for (int64_t first = 0; first < length; first += kv_cache.block_size) {
            const float* block = kv_cache.values + blocks_of[first / kv_cache.block_size] * kv_cache.block_stride() +
                                 kv * head_dim;
            const int64_t here = std::min(kv_cache.block_size, length - first);
            for (int64_t o = 0; o < here; ++o) {
                const float* value = block + o * token_stride;
                const float w = p[first + o];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * value[d];
            }
        }
        float* o = out + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] / total;
    }
}

// Attention of the single row of each sequence whose span has one row (others are left to the caller) over
// the sequence's seq_lens[s] keys: block_table [seqs, width] maps positions to blocks of the caches
// [blocks, block_size, kv_heads, head_dim]; q and out [tokens, heads, head_dim] (q rows q_stride apart).
void paged_decode_attention(uintptr_t q_ptr, uintptr_t keys_ptr, uintptr_t values_ptr, uintptr_t out_ptr,
                            uintptr_t query_start_ptr, uintptr_t seq_lens_ptr, uintptr_t block_table_ptr,
                            int64_t seqs, int64_t tokens, int64_t width, int64_t blocks, int64_t block_size,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t q_stride, double scale,
                            int threads) {
    const float* q = reinterpret_cast<const float*>(q_ptr);
    float* out = reinterpret_cast<float*>(out_ptr);
    const int32_t* query_start = as_i32(query_start_ptr);
    const int32_t* seq_lens = as_i32(seq_lens_ptr);
    if (kv_heads < 1 || heads % kv_heads != 0) throw pybind11::value_error("heads must be a multiple of kv_heads");
    check_starts(query_start, seqs, tokens);
    const PagedKV cache{reinterpret_cast<const float*>(keys_ptr), reinterpret_cast<const float*>(values_ptr),
                        as_i32(block_table_ptr), width, blocks, block_size, kv_heads, head_dim};
    std::vector<int64_t> single;  // the sequences this call computes
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; ++s) {
        if (query_start[s + 1] - query_start[s] != 1) continue;
        cache.check(s, seq_lens[s]);
        single.push_back(s);
        longest = std::max<int64_t>(longest, seq_lens[s]);
    }
    const int64_t group = heads / kv_heads, count = static_cast<int64_t>(single.size());
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(team(threads, count * kv_heads * longest / 64))
    {
        std::vector<float> scores(static_cast<size_t>(group * longest)), acc(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < count * kv_heads; ++unit) {
            const int64_t s = single[unit / kv_heads], kv = unit % kv_heads, row = query_start[s];
            const int64_t first_head = kv * group * head_dim;
            attend(cache, s, kv, seq_lens[s], q + row * q_stride + first_head, group, static_cast<float>(scale),
                   out + row * heads * head_dim + first_head, scores.data(), acc.data());
        }
    }
}

// SiLU of the depthwise causal conv of every sequence: x [tokens, channels] (rows x_stride apart), weight
// [channels, kernel]; conv_state [pool_slots, channels, kernel - 1], each sequence's slot read, then
// overwritten with its last kernel - 1 inputs; out [tokens, channels]. Taps added in order, as the reference.
// A unit is (sequence, CONV_CHANNELS channels): its inputs laid out time by time (the state's, then the rows')
// so that each tap is one vectorised pass over the channels.
constexpr int64_t CONV_CHANNELS = 64;

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
    const int64_t keep = kernel - 1, blocks = (channels + CONV_CHANNELS - 1) / CONV_CHANNELS;
    int64_t longest = 0;
    for (int64_t s = 0; s < seqs; ++s) longest = std::max<int64_t>(longest, query_start[s + 1] - query_start[s]);
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(team(threads, query_start[seqs] * channels / 256))
    {
        std::vector<float> inputs(static_cast<size_t>((keep + longest) * CONV_CHANNELS));
        float taps[16][CONV_CHANNELS];
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < seqs; ++s) {
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t c0 = b * CONV_CHANNELS, width = std::min(CONV_CHANNELS, channels - c0);
                const int64_t start = query_start[s], length = query_start[s + 1] - start;
                float* held = state + (slots[s] * channels + c0) * keep;
                for (int64_t c = 0; c < width; ++c) {
                    for (int64_t j = 0; j < kernel; ++j) taps[j][c] = weight[(c0 + c) * kernel + j];
                    for (int64_t j = 0; j < keep; ++j) inputs[j * CONV_CHANNELS + c] = held[c * keep + j];
                }
                for (int64_t t = 0; t < length; ++t) {
                    std::memcpy(&inputs[(keep + t) * CONV_CHANNELS], x + (start + t) * x_stride + c0, width * sizeof(float));
                }
                for (int64_t t = 0; t < length; ++t) {
                    float* o = out + (start + t) * channels + c0;
                    const float* in = &inputs[t * CONV_CHANNELS];
#pragma omp simd
                    for (int64_t c = 0; c < width; ++c) o[c] = in[c] * taps[0][c];
                    for (int64_t j = 1; j < kernel; ++j) {
                        const float* tap_in = in + j * CONV_CHANNELS;
#pragma omp simd
                        for (int64_t c = 0; c < width; ++c) o[c] = o[c] + tap_in[c] * taps[j][c];
                    }
#pragma omp simd
                    for (int64_t c = 0; c < width; ++c) o[c] = dot::silu(o[c]);
                }
                for (int64_t c = 0; c < width; ++c) {
                    for (int64_t j = 0; j < keep; ++j) held[c * keep + j] = inputs[(length + j) * CONV_CHANNELS + c];
                }
            }
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

// RMSNorm of one head `in` [dim] with its weight (times 1 + weight with `offset`), then neox rotary over the
// first `rotary` dims with this token's cos, sin [rotary], into `out` [dim].
inline void norm_rope_head(const float* in, const float* weight, float eps, bool offset, const float* cos,
                           const float* sin, int64_t dim, int64_t rotary, float* out) {
    float squares = 0.0f;
    for (int64_t d = 0; d < dim; ++d) squares += in[d] * in[d];
    const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
    float normed[MAX_HEAD_DIM];
    for (int64_t d = 0; d < dim; ++d) {
        const float n = in[d] * rstd;
        normed[d] = offset ? n * (1.0f + weight[d]) : weight[d] * n;
    }
    const int64_t half = rotary / 2;
    for (int64_t d = 0; d < half; ++d) {
        out[d] = normed[d] * cos[d] + -normed[d + half] * sin[d];
        out[d + half] = normed[d + half] * cos[d + half] + normed[d] * sin[d + half];
    }
    for (int64_t d = rotary; d < dim; ++d) out[d] = normed[d];
}

void check_rotary(int64_t dim, int64_t rotary) {
    if (rotary % 2 != 0 || rotary > dim) throw pybind11::value_error("rotary dims must be even and at most dim");
    if (dim > MAX_HEAD_DIM) throw pybind11::value_error("head_dim must be at most " + std::to_string(MAX_HEAD_DIM));
}

// RMSNorm of each head of q [tokens, q_heads, dim] and k [tokens, k_heads, dim] (rows q_stride / k_stride
// apart) with its weight, then rotary with cos, sin [tokens, rotary] (norm_rope_head); into q_out
// [tokens, q_heads, dim] and k_out [tokens, k_heads, dim].
void qk_norm_rope(uintptr_t q_ptr, uintptr_t k_ptr, uintptr_t q_weight_ptr, uintptr_t k_weight_ptr,
                  uintptr_t cos_ptr, uintptr_t sin_ptr, uintptr_t q_out_ptr, uintptr_t k_out_ptr, int64_t tokens,
                  int64_t q_heads, int64_t k_heads, int64_t dim, int64_t rotary, int64_t q_stride, int64_t k_stride,
                  double eps, bool offset, int threads) {
    check_rotary(dim, rotary);
    const float* cos = reinterpret_cast<const float*>(cos_ptr);
    const float* sin = reinterpret_cast<const float*>(sin_ptr);
    const int64_t heads = q_heads + k_heads;
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(team(threads, tokens * heads / 8))
    for (int64_t unit = 0; unit < tokens * heads; ++unit) {
        const int64_t t = unit / heads, h = unit % heads;
        const bool is_q = h < q_heads;
        const int64_t head = is_q ? h : h - q_heads;
        const float* in = reinterpret_cast<const float*>(is_q ? q_ptr : k_ptr) + t * (is_q ? q_stride : k_stride) +
                          head * dim;
        float* out = reinterpret_cast<float*>(is_q ? q_out_ptr : k_out_ptr) + (t * (is_q ? q_heads : k_heads) + head) * dim;
        norm_rope_head(in, reinterpret_cast<const float*>(is_q ? q_weight_ptr : k_weight_ptr), static_cast<float>(eps),
                       offset, cos + t * rotary, sin + t * rotary, dim, rotary, out);
    }
}

// An attention layer's whole step for one decode row per sequence: x [n, hidden] -> y [n, hidden]. In one
// thread team: the q, k, v projection qkv [(heads * (gated ? 2 : 1) + 2 kv_heads) * head_dim, hidden] (q of a
// head followed by its gate when gated); per head RMSNorm and rotary of q and k (norm_rope_head; cos, sin
// [n, rotary]); k and v written at each row's slot_mapping[s] of the caches; attention over the seq_lens[s]
// keys of sequence s (block_table row s); times sigmoid(gate) when gated; then o_proj [hidden, heads * head_dim].
void attention_decode(uintptr_t x_ptr, uintptr_t y_ptr, int64_t n, int64_t hidden, uintptr_t qkv_ptr, int qkv_kind,
                      uintptr_t o_ptr, int o_kind, uintptr_t q_norm_ptr, uintptr_t k_norm_ptr, double eps, bool offset,
                      uintptr_t cos_ptr, uintptr_t sin_ptr, int64_t rotary, uintptr_t keys_ptr, uintptr_t values_ptr,
                      uintptr_t slot_mapping_ptr, uintptr_t block_table_ptr, uintptr_t seq_lens_ptr, int64_t width,
                      int64_t blocks, int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                      bool gated, int threads) {
    if (kv_heads < 1 || heads % kv_heads != 0) throw pybind11::value_error("heads must be a multiple of kv_heads");
    check_rotary(head_dim, rotary);
    for (int kind : {qkv_kind, o_kind}) {
        if (kind != 0 && kind != 1) throw pybind11::value_error("projections take fp32 or bf16 weights");
    }
    const PagedKV cache{reinterpret_cast<const float*>(keys_ptr), reinterpret_cast<const float*>(values_ptr),
                        as_i32(block_table_ptr), width, blocks, block_size, kv_heads, head_dim};
    const int32_t* seq_lens = as_i32(seq_lens_ptr);
    const int64_t* slot_mapping = as_i64(slot_mapping_ptr);
    int64_t longest = 0;
    for (int64_t s = 0; s < n; ++s) {
        cache.check(s, seq_lens[s]);
        if (slot_mapping[s] < 0 || slot_mapping[s] >= blocks * block_size) {
            throw pybind11::value_error("slot_mapping must be in [0, blocks * block_size)");
        }
        longest = std::max<int64_t>(longest, seq_lens[s]);
    }
    const int64_t q_width = (gated ? 2 : 1) * head_dim, q_rows = heads * q_width, kv_dim = kv_heads * head_dim;
    const int64_t qkv_rows = q_rows + 2 * kv_dim, group = heads / kv_heads;
    const dot::Matrix qkv{reinterpret_cast<const char*>(qkv_ptr), static_cast<dot::Kind>(qkv_kind), hidden, nullptr};
    const dot::Matrix o{reinterpret_cast<const char*>(o_ptr), static_cast<dot::Kind>(o_kind), heads * head_dim, nullptr};
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const float* cos = reinterpret_cast<const float*>(cos_ptr);
    const float* sin = reinterpret_cast<const float*>(sin_ptr);
    const float* q_norm = reinterpret_cast<const float*>(q_norm_ptr);
    const float* k_norm = reinterpret_cast<const float*>(k_norm_ptr);
    float* keys = reinterpret_cast<float*>(keys_ptr);
    float* values = reinterpret_cast<float*>(values_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    std::vector<float> projected(static_cast<size_t>(n * qkv_rows)), queries(static_cast<size_t>(n * heads * head_dim));
    std::vector<float> attended(static_cast<size_t>(n * heads * head_dim));
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim)), feps = static_cast<float>(eps);
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(std::max(1, threads))
    {
        std::vector<float> scores(static_cast<size_t>(group * longest)), acc(static_cast<size_t>(head_dim));
#pragma omp for schedule(static)
        for (int64_t quad = 0; quad < (qkv_rows + 3) / 4; ++quad) {
            dot::project_quad(qkv, qkv_rows, quad, x, n, projected.data(), qkv_rows);
        }
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < n * (heads + kv_heads); ++unit) {
            const int64_t s = unit / (heads + kv_heads), h = unit % (heads + kv_heads);
            const float* row = &projected[s * qkv_rows];
            if (h < heads) {
                norm_rope_head(row + h * q_width, q_norm, feps, offset, cos + s * rotary, sin + s * rotary, head_dim,
                               rotary, &queries[(s * heads + h) * head_dim]);
            } else {
                const int64_t kv = h - heads, at = slot_mapping[s] * kv_dim + kv * head_dim;
                norm_rope_head(row + q_rows + kv * head_dim, k_norm, feps, offset, cos + s * rotary, sin + s * rotary,
                               head_dim, rotary, keys + at);
                std::memcpy(values + at, row + q_rows + kv_dim + kv * head_dim, head_dim * sizeof(float));
            }
        }
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < n * kv_heads; ++unit) {
            const int64_t s = unit / kv_heads, kv = unit % kv_heads, first = (s * heads + kv * group) * head_dim;
            attend(cache, s, kv, seq_lens[s], &queries[first], group, scale, &attended[first], scores.data(),
                   acc.data());
            for (int64_t g = 0; gated && g < group; ++g) {
                const float* gate = &projected[s * qkv_rows + (kv * group + g) * q_width + head_dim];
                float* out = &attended[first + g * head_dim];
                for (int64_t d = 0; d < head_dim; ++d) out[d] *= 1.0f / (1.0f + dot::exp(-gate[d]));
            }
        }
#pragma omp for schedule(static)
        for (int64_t quad = 0; quad < (hidden + 3) / 4; ++quad) {
            dot::project_quad(o, hidden, quad, attended.data(), n, y, hidden);
        }
    }
}

// A Gated DeltaNet layer's whole step for one decode row per sequence: x [n, hidden] (row s of sequence s,
// whose state slot is slots[s]) -> y [n, hidden]. The layer's arithmetic in order, in one thread team:
//   the projections in_proj_qkvz [k_heads * (2 dk + 2 per dv), hidden] and in_proj_ba [k_heads * 2 per, hidden]
//   (per = v_heads / k_heads; grouped per key head as the checkpoint stores them);
//   the causal conv + SiLU of the mixed q, k, v channels (conv weight [channels, kernel] fp32) on the conv state
//   [pool_slots, channels, kernel - 1], updated in place;
//   per value head: beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias), the delta rule on the
//   recurrent state [pool_slots, v_heads, dk, dv] (updated in place), then RMSNorm of its output (norm [dv])
//   times silu(z);
//   out_proj [hidden, v_heads * dv].
void gdn_decode(uintptr_t x_ptr, uintptr_t y_ptr, int64_t n, int64_t hidden, uintptr_t qkvz_ptr, int qkvz_kind,
                uintptr_t ba_ptr, int ba_kind, uintptr_t out_ptr, int out_kind, uintptr_t conv_ptr, int64_t kernel,
                uintptr_t dt_bias_ptr, uintptr_t a_log_ptr, uintptr_t norm_ptr, double eps, uintptr_t conv_state_ptr,
                uintptr_t recurrent_ptr, int64_t pool_slots, uintptr_t slots_ptr, int64_t k_heads, int64_t v_heads,
                int64_t dk, int64_t dv, int threads) {
    if (k_heads < 1 || v_heads % k_heads != 0) throw pybind11::value_error("v_heads must be a multiple of k_heads");
    if (kernel < 2 || kernel > 16) throw pybind11::value_error("the conv kernel must have 2 to 16 taps");
    if (dv > MAX_HEAD_DIM) throw pybind11::value_error("dv must be at most " + std::to_string(MAX_HEAD_DIM));
    const int64_t* slots = as_i64(slots_ptr);
    check_slots(slots, n, pool_slots, "state_slots");
    for (int kind : {qkvz_kind, ba_kind, out_kind}) {
        if (kind != 0 && kind != 1) throw pybind11::value_error("projections take fp32 or bf16 weights");
    }
    const int64_t per = v_heads / k_heads, group = 2 * dk + 2 * per * dv, key_dim = k_heads * dk;
    const int64_t value_dim = v_heads * dv, channels = 2 * key_dim + value_dim, keep = kernel - 1;
    const dot::Matrix qkvz{reinterpret_cast<const char*>(qkvz_ptr), static_cast<dot::Kind>(qkvz_kind), hidden, nullptr};
    const dot::Matrix ba{reinterpret_cast<const char*>(ba_ptr), static_cast<dot::Kind>(ba_kind), hidden, nullptr};
    const dot::Matrix out{reinterpret_cast<const char*>(out_ptr), static_cast<dot::Kind>(out_kind), value_dim, nullptr};
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const float* conv_w = reinterpret_cast<const float*>(conv_ptr);
    const float* dt_bias = reinterpret_cast<const float*>(dt_bias_ptr);
    const float* a_log = reinterpret_cast<const float*>(a_log_ptr);
    const float* norm = reinterpret_cast<const float*>(norm_ptr);
    float* conv_state = reinterpret_cast<float*>(conv_state_ptr);
    float* recurrent = reinterpret_cast<float*>(recurrent_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    const int64_t qkvz_rows = k_heads * group, ba_rows = 2 * v_heads;
    std::vector<float> projected(static_cast<size_t>(n * qkvz_rows)), gates(static_cast<size_t>(n * ba_rows));
    std::vector<float> mixed(static_cast<size_t>(n * channels)), normed(static_cast<size_t>(n * value_dim));
    const int64_t qkvz_quads = (qkvz_rows + 3) / 4, ba_quads = (ba_rows + 3) / 4;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dk)), feps = static_cast<float>(eps);
    pybind11::gil_scoped_release release;
#pragma omp parallel num_threads(std::max(1, threads))
    {
#pragma omp for schedule(static)
        for (int64_t quad = 0; quad < qkvz_quads + ba_quads; ++quad) {
            if (quad < qkvz_quads) {
                dot::project_quad(qkvz, qkvz_rows, quad, x, n, projected.data(), qkvz_rows);
            } else {
                dot::project_quad(ba, ba_rows, quad - qkvz_quads, x, n, gates.data(), ba_rows);
            }
        }
        // the conv's channels are q of every key head, then k of every key head, then v of every value head
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < n; ++s) {
            for (int64_t c = 0; c < channels; ++c) {
                int64_t at;
                if (c < key_dim) {
                    at = (c / dk) * group + c % dk;
                } else if (c < 2 * key_dim) {
                    at = ((c - key_dim) / dk) * group + dk + (c - key_dim) % dk;
                } else {
                    const int64_t v = c - 2 * key_dim;
                    at = (v / (per * dv)) * group + 2 * dk + v % (per * dv);
                }
                const float input = projected[s * qkvz_rows + at];
                float* held = conv_state + (slots[s] * channels + c) * keep;
                const float* w = conv_w + c * kernel;
                float acc = held[0] * w[0];
                for (int64_t j = 1; j < keep; ++j) acc = acc + held[j] * w[j];
                acc = acc + input * w[keep];
                for (int64_t j = 0; j + 1 < keep; ++j) held[j] = held[j + 1];
                held[keep - 1] = input;
                mixed[s * channels + c] = dot::silu(acc);
            }
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t s = 0; s < n; ++s) {
            for (int64_t h = 0; h < v_heads; ++h) {
                const int64_t kh = h / per, i = h % per;
                const float* qt = &mixed[s * channels + kh * dk];
                const float* kt = &mixed[s * channels + key_dim + kh * dk];
                const float* vt = &mixed[s * channels + 2 * key_dim + h * dv];
                const float* zt = &projected[s * qkvz_rows + kh * group + 2 * dk + per * dv + i * dv];
                const float b = gates[s * ba_rows + kh * 2 * per + i];
                const float a = gates[s * ba_rows + kh * 2 * per + per + i] + dt_bias[h];
                const float softplus = a > 20.0f ? a : std::log1p(dot::exp(a));
                const float decay = dot::exp(-dot::exp(a_log[h]) * softplus), beta = 1.0f / (1.0f + dot::exp(-b));
                float qq = 0.0f, kk = 0.0f;
                for (int64_t d = 0; d < dk; ++d) {
                    qq += qt[d] * qt[d];
                    kk += kt[d] * kt[d];
                }
                const float qs = scale / std::sqrt(qq + 1e-6f), ks = 1.0f / std::sqrt(kk + 1e-6f);
                float* S = recurrent + (slots[s] * v_heads + h) * dk * dv;
                float predicted[MAX_HEAD_DIM], core[MAX_HEAD_DIM];
                std::fill(predicted, predicted + dv, 0.0f);
                for (int64_t d = 0; d < dk; ++d) {
                    float* row = S + d * dv;
                    const float kd = kt[d] * ks;
#pragma omp simd
                    for (int64_t e = 0; e < dv; ++e) {
                        row[e] *= decay;
                        predicted[e] += kd * row[e];
                    }
                }
                for (int64_t e = 0; e < dv; ++e) predicted[e] = (vt[e] - predicted[e]) * beta;
                std::fill(core, core + dv, 0.0f);
                for (int64_t d = 0; d < dk; ++d) {
                    float* row = S + d * dv;
                    const float kd = kt[d] * ks, qd = qt[d] * qs;
#pragma omp simd
                    for (int64_t e = 0; e < dv; ++e) {
                        row[e] += kd * predicted[e];
                        core[e] += qd * row[e];
                    }
                }
                float squares = 0.0f;
                for (int64_t e = 0; e < dv; ++e) squares += core[e] * core[e];
                const float rstd = 1.0f / std::sqrt(squares / static_cast<float>(dv) + feps);
                float* o = &normed[s * value_dim + h * dv];
                for (int64_t e = 0; e < dv; ++e) o[e] = norm[e] * (core[e] * rstd) * dot::silu(zt[e]);
            }
        }
#pragma omp for schedule(static)
        for (int64_t quad = 0; quad < (hidden + 3) / 4; ++quad) {
            dot::project_quad(out, hidden, quad, normed.data(), n, y, hidden);
        }
    }
}

}  // namespace

void register_sequence_kernels(pybind11::module_& m) {
    m.def("paged_decode_attention", &paged_decode_attention,
          "attention of single-row sequences over the paged KV cache; raw pointers, see cpu_sequence.py");
    m.def("conv_varlen", &conv_varlen, "Gated DeltaNet's causal conv + SiLU; raw pointers, see cpu_sequence.py");
    m.def("delta_rule_varlen", &delta_rule_varlen,
          "the gated delta rule token by token; raw pointers, see cpu_sequence.py");
    m.def("attention_decode", &attention_decode,
          "an attention layer's decode step over the paged cache; raw pointers, see cpu_sequence.py");
    m.def("gdn_decode", &gdn_decode, "a Gated DeltaNet layer's decode step; raw pointers, see cpu_sequence.py");
    m.def("qk_norm_rope", &qk_norm_rope, "per-head RMSNorm and rotary of q, k; raw pointers, see cpu_sequence.py");
}
