// The CPU expert pool's and the CPU backend set's MLP kernels: SwiGLU experts over the rows routed to each,
// from host RAM, and around them the decode-time pieces of a layer (router, dense rows, norms).
//
//   h[t, j] = silu(gate_j . x_t) * (up_j . x_t)      j < inter
//   y[t, i] = down_i . h_t                            i < hidden
//
// x [n, hidden] and y [n, hidden] are fp32; the weights fp32, bf16, int8 with one fp32 scale per output row, or
// GGUF's blocks of Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS or IQ3_S (the i-quants read the tables `set_tables`
// hands over).
// A call's experts run together in one OpenMP team, in two passes (gate and up, then down) whose work units
// are (expert, a few output rows) pairs; dot products as native/dot.h computes them, so a row's result never
// depends on what else shares the call. Registered with the native module (native/module.cpp); called from
// app/kernels/cpu_experts.py, which checks shapes, dtypes and contiguity and passes raw pointers.

#include "background.h"
#include "dot.h"
#include "int_dot.h"
#include "kernels.h"
#include "pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using dot::Kind;
using dot::Matrix;
using dot::silu;
using dot::TILE;

constexpr const char* BLOCKS = "Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, IQ3_XXS or IQ3_S";  // GGUF types read, for messages

// One SwiGLU MLP (gate, up [inter, hidden], down [hidden, inter]) and the entries [first, last) it takes.
struct Group {
    Matrix gate, up, down;
    int64_t inter, first, last;
};

// The units of work of a call's two passes: gate and up rows by pairs, down rows by fours, of every group.
struct Passes {
    std::vector<Group> groups;
    std::vector<int64_t> gate_units{0}, down_units{0};  // prefix sums over the groups
    int64_t hidden = 0, widest = 0;                      // widest: the largest inter, h's row stride
    int64_t entries = 0;                                 // the entries the groups take, [0, entries)
    bool quantized = false;                              // whether a group's weights sum in integers (`int_dot.h`)
    bool paired_x = false, paired_h = false;             // whether a group's gate / down is Q6_K (pair sums)

    Passes(std::vector<Group> all, int64_t hidden_size) : groups(std::move(all)), hidden(hidden_size) {
        for (const Group& g : groups) {
            gate_units.push_back(gate_units.back() + (g.inter + 1) / 2);
            down_units.push_back(down_units.back() + (hidden + 3) / 4);
            widest = std::max(widest, g.inter);
            entries = std::max(entries, g.last);
            quantized = quantized || dot::integer_kind(g.gate.kind) || dot::integer_kind(g.down.kind);
            paired_x = paired_x || g.gate.kind == dot::Kind::Q6_K;
            paired_h = paired_h || g.down.kind == dot::Kind::Q6_K;
        }
    }

    // The group whose entries hold entry k (the groups' entries run in order).
    size_t group_at(int64_t k) const {
        const auto after = std::upper_bound(groups.begin(), groups.end(), k,
                                            [](int64_t entry, const Group& g) { return entry < g.first; });
        return static_cast<size_t>(after - groups.begin() - 1);
    }

    static size_t group_of(const std::vector<int64_t>& units, int64_t unit) {
        return static_cast<size_t>(std::upper_bound(units.begin(), units.end(), unit) - units.begin() - 1);
    }
};

// Token vectors of a group's entries, TILE at a time: calls f(first entry, count, vectors).
template <typename F>
inline void by_tiles(const Group& g, const float* base, int64_t stride, F f) {
    for (int64_t first = g.first; first < g.last; first += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, g.last - first));
        const float* xs[TILE];
        for (int k = 0; k < count; ++k) xs[k] = base + (first + k) * stride;
        f(first, count, xs);
    }
}

// Token vectors of a group's entries quantized for its rows of `kind` (Q4_K, Q5_K or Q6_K: `int_dot.h`), TILE at
// a time as by_tiles.
template <typename F>
inline void by_quantized_tiles(const Group& g, dot::QuantizedRows& q, dot::Kind kind, F f) {
    for (int64_t first = g.first; first < g.last; first += TILE) {
        const int count = static_cast<int>(std::min<int64_t>(TILE, g.last - first));
        dot::Quantized vectors[TILE];
        for (int k = 0; k < count; ++k) vectors[k] = q.at(first + k, kind == dot::Kind::Q6_K);
        f(first, count, vectors);
    }
}

// Every entry of a group whose gate and up's weights (or with `down` the down's) sum in integers quantized into
// q: its row of `base` (`stride` apart), the group's first hidden (or inter) values. Called by every thread of a
// team.
void quantize_entries(const Passes& p, bool down, const float* base, int64_t stride, dot::QuantizedRows& q) {
#pragma omp for schedule(static)
    for (int64_t k = 0; k < p.entries; ++k) {
        const Group& g = p.groups[p.group_at(k)];
        const dot::Kind kind = down ? g.down.kind : g.gate.kind;
        if (dot::integer_kind(kind)) {
            dot::quantize(base + k * stride, down ? g.inter : p.hidden, kind, q.at(k, kind == dot::Kind::Q6_K));
        }
    }
}

// h [entries, widest] = silu(gate . x) * (up . x), then ys [entries, hidden] = down . h, for every group's
// entries of xs [entries, hidden]; Q4_K, Q5_K and Q6_K groups' token vectors quantized first (into qx, qh:
// `int_dot.h`).
// Called by every thread of a team (each pass ends in the team's barrier).
void swiglu_team(const Passes& p, const float* xs, float* h, float* ys, dot::QuantizedRows& qx,
                 dot::QuantizedRows& qh) {
    const int64_t hidden = p.hidden, stride = p.widest;
    std::vector<float> wide(static_cast<size_t>(4 * std::max(hidden, stride)));  // this thread's widened rows
    if (p.quantized) quantize_entries(p, false, xs, hidden, qx);
#pragma omp for schedule(dynamic, 8)
    for (int64_t unit = 0; unit < p.gate_units.back(); ++unit) {
        const size_t gi = Passes::group_of(p.gate_units, unit);
        const Group& g = p.groups[gi];
        const int64_t j = 2 * (unit - p.gate_units[gi]);
        const bool pair = j + 1 < g.inter;
        const char* rows[4] = {g.gate.row(j), pair ? g.gate.row(j + 1) : g.up.row(j), g.up.row(j), g.up.row(j + 1)};
        const char* ahead[4] = {g.gate.row(j + 2), g.gate.row(j + 3), g.up.row(j + 2), g.up.row(j + 3)};
        const auto keep = [&](int64_t first, int count, float (*out)[TILE]) {
            if (!pair) std::memcpy(out[2], out[1], sizeof out[1]);  // rows: gate j, up j
            for (int k = 0; k < count; ++k) {
                float* row = h + (first + k) * stride;
                row[j] = silu(out[0][k] * g.gate.scale(j)) * (out[2][k] * g.up.scale(j));
                if (pair) row[j + 1] = silu(out[1][k] * g.gate.scale(j + 1)) * (out[3][k] * g.up.scale(j + 1));
            }
        };
        if (dot::integer_kind(g.gate.kind)) {
            by_quantized_tiles(g, qx, g.gate.kind, [&](int64_t first, int count, const dot::Quantized* vectors) {
                float out[4][TILE];
                const bool next = first + TILE >= g.last && j + 4 <= g.inter;  // the next pair, on the last tile
                if (pair) {
                    dot::qk_rows<4>(g.gate.kind, rows, hidden, vectors, count, out, next ? ahead : nullptr);
                } else {
                    dot::qk_rows<2>(g.gate.kind, rows, hidden, vectors, count, out);
                }
                keep(first, count, out);
            });
            continue;
        }
        const dot::Kind kind = pair ? dot::widen_rows<4>(g.gate.kind, rows, hidden, g.last - g.first, wide.data())
                                    : dot::widen_rows<2>(g.gate.kind, rows, hidden, g.last - g.first, wide.data());
        by_tiles(g, xs, hidden, [&](int64_t first, int count, const float* const* vectors) {
            float out[4][TILE];
            if (pair) {
                const bool next = first + TILE >= g.last && j + 4 <= g.inter;  // the next pair, on the last tile
                dot::dot_rows<4>(kind, rows, hidden, vectors, count, out, next ? ahead : nullptr);
            } else {
                dot::dot_rows<2>(kind, rows, hidden, vectors, count, out);
            }
            keep(first, count, out);
        });
    }
    if (p.quantized) quantize_entries(p, true, h, stride, qh);
#pragma omp for schedule(dynamic, 8)
    for (int64_t unit = 0; unit < p.down_units.back(); ++unit) {
        const size_t gi = Passes::group_of(p.down_units, unit);
        const Group& g = p.groups[gi];
        const int64_t i = 4 * (unit - p.down_units[gi]);
        const int rows_here = static_cast<int>(std::min<int64_t>(4, hidden - i));
        const char* rows[4] = {g.down.row(i), g.down.row(i + 1), g.down.row(i + 2), g.down.row(i + 3)};
        const char* ahead[4] = {g.down.row(i + 4), g.down.row(i + 5), g.down.row(i + 6), g.down.row(i + 7)};
        const auto keep = [&](int64_t first, int count, float (*out)[TILE]) {
            for (int r = 0; r < rows_here; ++r) {
                for (int k = 0; k < count; ++k) ys[(first + k) * hidden + i + r] = out[r][k] * g.down.scale(i + r);
            }
        };
        if (dot::integer_kind(g.down.kind)) {
            by_quantized_tiles(g, qh, g.down.kind, [&](int64_t first, int count, const dot::Quantized* vectors) {
                float out[4][TILE];
                if (rows_here == 4) {
                    const bool next = first + TILE >= g.last && i + 8 <= hidden;  // the next four, on the last tile
                    dot::qk_rows<4>(g.down.kind, rows, g.inter, vectors, count, out, next ? ahead : nullptr);
                } else {
                    for (int r = 0; r < rows_here; ++r) {
                        dot::qk_rows<1>(g.down.kind, rows + r, g.inter, vectors, count, &out[r]);
                    }
                }
                keep(first, count, out);
            });
            continue;
        }
        const dot::Kind kind =
            rows_here == 4 ? dot::widen_rows<4>(g.down.kind, rows, g.inter, g.last - g.first, wide.data()) : g.down.kind;
        by_tiles(g, h, stride, [&](int64_t first, int count, const float* const* vectors) {
            float out[4][TILE];
            if (rows_here == 4) {
                const bool next = first + TILE >= g.last && i + 8 <= hidden;  // the next four, on the last tile
                dot::dot_rows<4>(kind, rows, g.inter, vectors, count, out, next ? ahead : nullptr);
            } else {
                for (int r = 0; r < rows_here; ++r) {
                    const char* row[1] = {g.down.row(i + r)};
                    dot::dot_rows<1>(g.down.kind, row, g.inter, vectors, count, &out[r]);
                }
            }
            keep(first, count, out);
        });
    }
}

// Buffers for the quantized token vectors of a call's Q4_K, Q5_K and Q6_K groups: the inputs and the intermediate
// rows (empty where no group sums in integers).
struct QuantizedInputs {
    dot::QuantizedRows x, h;
    explicit QuantizedInputs(const Passes& p)
        : x(p.quantized ? p.entries : 0, p.hidden, p.paired_x), h(p.quantized ? p.entries : 0, p.widest, p.paired_h) {}
};

// Sets a run's done word (if any) to 1 when it leaves scope: once the run's sums are written, or it threw.
struct DoneOnExit {
    int32_t* word;
    ~DoneOnExit() {
        if (word) __atomic_store_n(word, 1, __ATOMIC_RELEASE);
    }
};

// The thread of the pool's background runs (never destroyed: a run may outlive the interpreter's exit).
BackgroundRuns& pool_runs() {
    static auto* runs = new BackgroundRuns;
    return *runs;
}

// y[rows[k]] += weights[k] * (the SwiGLU of x[rows[k]] through entry k's group), for every entry (grouped as
// p says), in one team: the rows gathered, the two passes, then the sums added by blocks of columns, entries
// in order.
void add_groups(const Passes& p, const float* x, float* y, const int64_t* rows, const float* weights,
                int64_t entries, int threads) {
    const int64_t hidden = p.hidden;
    std::vector<float> xs(static_cast<size_t>(entries * hidden)), ys(static_cast<size_t>(entries * hidden));
    std::vector<float> h(static_cast<size_t>(entries * p.widest));
    QuantizedInputs quantized(p);
    constexpr int64_t COLUMNS = 64;  // columns of y a thread adds at a time
    const int64_t blocks = (hidden + COLUMNS - 1) / COLUMNS;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t k = 0; k < entries; ++k) std::memcpy(&xs[k * hidden], x + rows[k] * hidden, hidden * 4);
        swiglu_team(p, xs.data(), h.data(), ys.data(), quantized.x, quantized.h);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t low = b * COLUMNS, high = std::min(hidden, low + COLUMNS);
            for (int64_t k = 0; k < entries; ++k) {
                float* out = y + rows[k] * hidden;
                const float w = weights[k];
                const float* in = &ys[k * hidden];
                for (int64_t c = low; c < high; ++c) out[c] += w * in[c];
            }
        }
    }
}

// The kind of a kernel's argument (a weight's), checked: int8 weights need `scales_ptr`, the i-quants their tables.
// An expert's gate_up and down may be of two kinds (a Q4_K_M file's Q6_K down projections beside Q4_K gates).
Kind checked_kind(int kind_code, uintptr_t scales_ptr) {
    const auto kind = static_cast<Kind>(kind_code);
    dot::row_bytes(kind, 0);
    if (kind == Kind::I8 && scales_ptr == 0) {
        throw std::invalid_argument("int8 weights need their scales");
    }
    if (dot::reads_tables(kind) && !dot::tables.loaded) {
        throw std::invalid_argument("i-quant weights need their tables: set_tables first");
    }
    return kind;
}

// dot::tables from their bytes: IQ4_NL's 16 levels (int8), the IQ3_XXS grid [256, 4] and the IQ3_S grid [512, 4]
// (uint8), llama.cpp's as the gguf package carries them. Once, before the first call on i-quant weights.
void set_tables(const pybind11::bytes& iq4_levels, const pybind11::bytes& iq3_xxs_grid,
                const pybind11::bytes& iq3_s_grid) {
    const std::string levels = iq4_levels, xxs = iq3_xxs_grid, s = iq3_s_grid;
    dot::Tables& t = dot::tables;
    if (levels.size() != sizeof t.iq4 || xxs.size() != sizeof t.iq3_xxs || s.size() != sizeof t.iq3_s) {
        throw pybind11::value_error("tables: 16 IQ4_NL levels, 256 IQ3_XXS and 512 IQ3_S grid points of 4 bytes");
    }
    std::memcpy(t.iq4, levels.data(), sizeof t.iq4);
    std::memcpy(t.iq3_xxs, xxs.data(), sizeof t.iq3_xxs);
    std::memcpy(t.iq3_s, s.data(), sizeof t.iq3_s);
    t.loaded = true;
}

// Expert `expert` of stacked gate_up [E, 2 * inter, hidden] / down [E, hidden, inter] (scales [E, rows]).
Group stacked_expert(uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t gate_up_scales_ptr,
                     uintptr_t down_scales_ptr, Kind kind, Kind down_kind, int64_t expert, int64_t hidden,
                     int64_t inter, int64_t first, int64_t last) {
    const int64_t gate_row = dot::row_bytes(kind, hidden), down_row = dot::row_bytes(down_kind, inter);
    const char* gate_up = reinterpret_cast<const char*>(gate_up_ptr) + expert * 2 * inter * gate_row;
    const char* down = reinterpret_cast<const char*>(down_ptr) + expert * hidden * down_row;
    const auto* gu_scales = reinterpret_cast<const float*>(gate_up_scales_ptr);
    const auto* d_scales = reinterpret_cast<const float*>(down_scales_ptr);
    Group g;
    g.gate = Matrix{gate_up, kind, hidden, gu_scales ? gu_scales + expert * 2 * inter : nullptr};
    g.up = Matrix{gate_up + inter * gate_row, kind, hidden, gu_scales ? gu_scales + expert * 2 * inter + inter : nullptr};
    g.down = Matrix{down, down_kind, inter, d_scales ? d_scales + expert * hidden : nullptr};
    g.inter = inter;
    g.first = first;
    g.last = last;
    return g;
}

// y [n, hidden] = SwiGLU of x [n, hidden] through one expert.
void expert_swiglu(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr,
                   uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr, int64_t n, int64_t hidden,
                   int64_t inter, int kind_code, int down_kind_code, int threads) {
    const Kind kind = checked_kind(kind_code, gate_up_scales_ptr);
    const Kind down_kind = checked_kind(down_kind_code, down_scales_ptr);
    const Passes p({stacked_expert(gate_up_ptr, down_ptr, gate_up_scales_ptr, down_scales_ptr, kind, down_kind, 0,
                                   hidden, inter, 0, n)},
                   hidden);
    pybind11::gil_scoped_release release;
    std::vector<float> h(static_cast<size_t>(n * inter));
    QuantizedInputs quantized(p);
#pragma omp parallel num_threads(threads)
    swiglu_team(p, reinterpret_cast<const float*>(x_ptr), h.data(), reinterpret_cast<float*>(y_ptr), quantized.x,
                quantized.h);
}

}  // namespace

// y [n, hidden] += the weighted SwiGLU of several experts of one layer, each over the rows routed to it:
// expert experts[e] (an index into gate_up [E, 2 * inter, hidden] / down [E, hidden, inter], and their scales
// [E, rows]) takes entries offsets[e] .. offsets[e + 1] of rows / weights. One call for a window's CPU share.
// With channels_ptr (0: none; fp32, bf16 and int8 weights), expert e sums only its first channels[e]
// intermediate channels (gate and up rows, down columns): its share where the others are summed elsewhere.
// Every index is checked against n (rows of x and y), total (experts in gate_up / down) and entries (the
// length of rows / weights) before any memory is read. With `background` the run goes to the pool's own
// thread (`pool_runs`) and the call returns once it is handed over: every buffer named must stay as it is
// until pool_finish returns. With done_ptr (0: none), the int32 there is 1 once the sums are in y (or the run
// failed), 0 while a background run is going: the word a device waits on before it reads y (the expert tier's
// pinned `HostLink`).
void experts_swiglu_sum(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr,
                        uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr, int64_t hidden, int64_t inter,
                        int kind_code, int down_kind_code, int threads, uintptr_t experts_ptr,
                        uintptr_t offsets_ptr, uintptr_t rows_ptr, uintptr_t weights_ptr, int64_t count, int64_t n,
                        int64_t total, int64_t entries, uintptr_t channels_ptr, bool background,
                        uintptr_t done_ptr) {
    const Kind kind = checked_kind(kind_code, gate_up_scales_ptr);
    const Kind down_kind = checked_kind(down_kind_code, down_scales_ptr);
    const auto splits = [](Kind k) { return k == Kind::F32 || k == Kind::BF16 || k == Kind::I8; };
    const auto* experts = reinterpret_cast<const int64_t*>(experts_ptr);
    const auto* offsets = reinterpret_cast<const int64_t*>(offsets_ptr);
    const auto* rows = reinterpret_cast<const int64_t*>(rows_ptr);
    const auto* channels = reinterpret_cast<const int64_t*>(channels_ptr);
    if (channels && !(splits(kind) && splits(down_kind))) {
        // a held GGUF row is not its leading columns' blocks followed by the rest (Q8_0 keeps its codes first)
        throw pybind11::value_error("channels are for fp32, bf16 and int8 weights");
    }
    if (offsets[0] != 0 || offsets[count] != entries) {
        throw pybind11::value_error("offsets must bound each expert's entries of rows and weights");
    }
    std::vector<Group> groups;
    for (int64_t e = 0; e < count; ++e) {
        if (experts[e] < 0 || experts[e] >= total) {
            throw pybind11::value_error("experts must be in [0, " + std::to_string(total) + ")");
        }
        if (offsets[e + 1] < offsets[e]) {
            throw pybind11::value_error("offsets must bound each expert's entries of rows and weights");
        }
        groups.push_back(stacked_expert(gate_up_ptr, down_ptr, gate_up_scales_ptr, down_scales_ptr, kind, down_kind,
                                        experts[e], hidden, inter, offsets[e], offsets[e + 1]));
        if (channels) {
            if (channels[e] <= 0 || channels[e] > inter) {
                throw pybind11::value_error("channels must be in [1, " + std::to_string(inter) + "]");
            }
            groups.back().inter = channels[e];  // the matrices keep their rows' full length
        }
    }
    for (int64_t k = 0; k < entries; ++k) {
        if (rows[k] < 0 || rows[k] >= n) throw pybind11::value_error("rows must be in [0, " + std::to_string(n) + ")");
    }
    auto p = std::make_shared<const Passes>(std::move(groups), hidden);
    const auto* x = reinterpret_cast<const float*>(x_ptr);
    auto* y = reinterpret_cast<float*>(y_ptr);
    const auto* weights = reinterpret_cast<const float*>(weights_ptr);
    auto* done = reinterpret_cast<int32_t*>(done_ptr);
    const auto run = [=] {
        const DoneOnExit mark{done};  // set after every store to y, or when the run throws
        add_groups(*p, x, y, rows, weights, entries, threads);
    };
    if (background) {
        if (done) __atomic_store_n(done, 0, __ATOMIC_RELEASE);  // before the run could set it
        try {
            pool_runs().start(run);
        } catch (...) {
            if (done) __atomic_store_n(done, 1, __ATOMIC_RELEASE);
            throw;
        }
        return;
    }
    pybind11::gil_scoped_release release;
    run();
}

// Wait for the background run experts_swiglu_sum started; the seconds it took on the pool's thread.
double pool_finish() {
    pybind11::gil_scoped_release release;
    return pool_runs().finish();
}

namespace {

// The router's picks for one row of logits [experts]: softmax over all experts, the top_k (ties to the lower
// expert), their probabilities (renormalised to sum 1 with `renormalize`) into ids / weights [top_k], each pick
// added to counts [experts] by `live` (0 on a padding row). p and taken: scratch of `experts` entries.
void route_row(const float* logits, int64_t experts, int64_t top_k, bool renormalize, int64_t live, int64_t* ids,
               float* weights, int64_t* counts, float* p, char* taken) {
    float most = logits[0];
    for (int64_t e = 1; e < experts; ++e) most = std::max(most, logits[e]);
    float total = 0.0f;
    for (int64_t e = 0; e < experts; ++e) total += (p[e] = dot::exp(logits[e] - most));
    for (int64_t e = 0; e < experts; ++e) p[e] /= total;
    std::fill(taken, taken + experts, 0);
    float picked = 0.0f;
    for (int64_t k = 0; k < top_k; ++k) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e) {
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        }
        taken[best] = 1;
        ids[k] = best;
        weights[k] = p[best];
        picked += p[best];
        counts[best] += live;
    }
    if (renormalize) {
        for (int64_t k = 0; k < top_k; ++k) weights[k] /= picked;
    }
}

// The router's picks for each row of logits [rows, experts] (fp32), as route_row, counted by live[row] when
// given.
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
        route_row(logits + r * experts, experts, top_k, renormalize, live ? live[r] : 1, ids + r * top_k,
                  weights + r * top_k, counts, p.data(), taken.data());
    }
}

// The routed entries of ids [entries] (experts of [0, total)) grouped by expert: expert order, entry order
// within one. Returns the groups' experts and offsets; entry f goes to position order[f].
void group_entries(const int64_t* ids, int64_t entries, int64_t total, std::vector<int64_t>& experts,
                   std::vector<int64_t>& offsets, std::vector<int64_t>& order) {
    std::vector<int64_t> per(static_cast<size_t>(total + 1));
    for (int64_t f = 0; f < entries; ++f) {
        if (ids[f] < 0 || ids[f] >= total) {
            throw pybind11::value_error("expert ids must be in [0, " + std::to_string(total) + ")");
        }
        ++per[ids[f] + 1];
    }
    offsets.assign(1, 0);
    for (int64_t e = 0; e < total; ++e) {
        if (per[e + 1] == 0) continue;
        experts.push_back(e);
        offsets.push_back(offsets.back() + per[e + 1]);
    }
    for (int64_t e = 0; e < total; ++e) per[e + 1] += per[e];  // per[e]: where expert e's entries start
    order.resize(static_cast<size_t>(entries));
    for (int64_t f = 0; f < entries; ++f) order[f] = per[ids[f]]++;
}

// The groups of the routed entries of ids / top_weights [n, top_k] by expert (experts of stacked gate_up /
// down), each entry's row and weight written at its place in rows / weights [n * top_k].
std::vector<Group> routed_groups(const int64_t* ids, const float* top_weights, int64_t n, int64_t top_k,
                                 int64_t total, uintptr_t gate_up_ptr, uintptr_t down_ptr, Kind kind, Kind down_kind,
                                 int64_t hidden, int64_t inter, int64_t* rows, float* weights) {
    std::vector<int64_t> experts, offsets, order;
    group_entries(ids, n * top_k, total, experts, offsets, order);
    for (int64_t f = 0; f < n * top_k; ++f) {
        rows[order[f]] = f / top_k;
        weights[order[f]] = top_weights[f];
    }
    std::vector<Group> groups;
    for (size_t e = 0; e < experts.size(); ++e) {
        groups.push_back(stacked_expert(gate_up_ptr, down_ptr, 0, 0, kind, down_kind, experts[e], hidden, inter,
                                        offsets[e], offsets[e + 1]));
    }
    return groups;
}

// y [n, hidden] = the weighted sum of each row's top_k routed experts (ids and weights [n, top_k], experts of
// gate_up [total, 2 * inter, hidden] / down [total, hidden, inter]), the entries grouped by expert here.
void routed_experts(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr, int64_t hidden,
                    int64_t inter, int kind_code, int down_kind_code, int threads, uintptr_t ids_ptr,
                    uintptr_t top_weights_ptr, int64_t n, int64_t top_k, int64_t total) {
    const Kind kind = checked_kind(kind_code, 0), down_kind = checked_kind(down_kind_code, 0);
    if (kind == Kind::I8 || down_kind == Kind::I8) {
        throw pybind11::value_error(std::string("routed experts take fp32 or bf16 weights, or blocks of ") + BLOCKS);
    }
    const auto* ids = reinterpret_cast<const int64_t*>(ids_ptr);
    const auto* top_weights = reinterpret_cast<const float*>(top_weights_ptr);
    const int64_t entries = n * top_k;
    std::vector<int64_t> rows(static_cast<size_t>(entries));
    std::vector<float> weights(static_cast<size_t>(entries));
    const Passes p(routed_groups(ids, top_weights, n, top_k, total, gate_up_ptr, down_ptr, kind, down_kind, hidden,
                                 inter, rows.data(), weights.data()),
                   hidden);
    float* y = reinterpret_cast<float*>(y_ptr);
    pybind11::gil_scoped_release release;
    std::fill(y, y + n * hidden, 0.0f);
    add_groups(p, reinterpret_cast<const float*>(x_ptr), y, rows.data(), weights.data(), entries, threads);
}

// A sparse MoE block of a decode window in one call, y [n, hidden] from x [n, hidden]: router logits (router
// [total, hidden] of router_kind), the picks (route_row, counted into counts [total] by live[row] when given) into ids /
// top_weights [n, top_k], each row's routed experts (gate_up / down as routed_experts) and, when shared_gate_ptr
// is set, the shared expert (gate, up [shared_inter, hidden], down [hidden, shared_inter], of shared_kind)
// weighted by sigmoid(shared_router . x) (shared_router [hidden] of router_kind), added after the routed ones.
void moe_block(uintptr_t x_ptr, uintptr_t y_ptr, int64_t n, int64_t hidden, uintptr_t router_ptr, int router_kind_code,
               int64_t total,
               int64_t top_k, bool renormalize, uintptr_t counts_ptr, uintptr_t live_ptr, uintptr_t ids_ptr,
               uintptr_t top_weights_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, int kind_code, int down_kind_code,
               int64_t inter,
               uintptr_t shared_gate_ptr, uintptr_t shared_up_ptr, uintptr_t shared_down_ptr, int shared_kind_code,
               int64_t shared_inter, uintptr_t shared_router_ptr, int threads) {
    const Kind kind = checked_kind(kind_code, 0), down_kind = checked_kind(down_kind_code, 0);
    const Kind shared_kind = checked_kind(shared_kind_code, 0), router_kind = checked_kind(router_kind_code, 0);
    const auto plain = [](Kind k) { return k == Kind::F32 || k == Kind::BF16; };
    if (kind == Kind::I8 || down_kind == Kind::I8 || !plain(shared_kind) || !plain(router_kind)) {
        const std::string routed = std::string("(routed experts also blocks of ") + BLOCKS + ")";
        throw pybind11::value_error("MoE blocks take fp32 or bf16 weights " + routed);
    }
    if (top_k < 1 || top_k > total) throw pybind11::value_error("top_k must be in [1, experts]");
    const float* x = reinterpret_cast<const float*>(x_ptr);
    auto* ids = reinterpret_cast<int64_t*>(ids_ptr);
    auto* top_weights = reinterpret_cast<float*>(top_weights_ptr);
    const auto* live = reinterpret_cast<const int64_t*>(live_ptr);
    const bool shared = shared_gate_ptr != 0;
    const int64_t entries = n * top_k, all = entries + (shared ? n : 0);
    const Matrix router{reinterpret_cast<const char*>(router_ptr), router_kind, hidden, nullptr};
    const Matrix shared_router{reinterpret_cast<const char*>(shared_router_ptr), router_kind, hidden, nullptr};
    std::vector<float> logits(static_cast<size_t>(n * total)), p(static_cast<size_t>(total));
    std::vector<char> taken(static_cast<size_t>(total));
    std::vector<int64_t> rows(static_cast<size_t>(all));
    std::vector<float> weights(static_cast<size_t>(all));
    {
        pybind11::gil_scoped_release release;
        for (int64_t r = 0; r < n; ++r) {
            const float* xs[1] = {x + r * hidden};
            float out[1][TILE];
            for (int64_t e = 0; e < total; ++e) {
                const char* row[1] = {router.row(e)};
                dot::dot_rows<1>(router_kind, row, hidden, xs, 1, out);
                logits[r * total + e] = out[0][0];
            }
            route_row(&logits[r * total], total, top_k, renormalize, live ? live[r] : 1, ids + r * top_k,
                      top_weights + r * top_k, reinterpret_cast<int64_t*>(counts_ptr), p.data(), taken.data());
            if (shared) {
                const char* row[1] = {shared_router.row(0)};
                dot::dot_rows<1>(router_kind, row, hidden, xs, 1, out);
                rows[entries + r] = r;
                weights[entries + r] = 1.0f / (1.0f + dot::exp(-out[0][0]));
            }
        }
    }
    std::vector<Group> groups = routed_groups(ids, top_weights, n, top_k, total, gate_up_ptr, down_ptr, kind, down_kind,
                                              hidden, inter, rows.data(), weights.data());
    if (shared) {
        Group g;
        g.gate = Matrix{reinterpret_cast<const char*>(shared_gate_ptr), shared_kind, hidden, nullptr};
        g.up = Matrix{reinterpret_cast<const char*>(shared_up_ptr), shared_kind, hidden, nullptr};
        g.down = Matrix{reinterpret_cast<const char*>(shared_down_ptr), shared_kind, shared_inter, nullptr};
        g.inter = shared_inter;
        g.first = entries;
        g.last = all;
        groups.push_back(g);
    }
    const Passes passes(std::move(groups), hidden);
    float* y = reinterpret_cast<float*>(y_ptr);
    pybind11::gil_scoped_release release;
    std::fill(y, y + n * hidden, 0.0f);
    add_groups(passes, x, y, rows.data(), weights.data(), all, threads);
}

// y [n, out] = x [n, in] @ weight [out, in]^T (+ bias [out]), fp32 results: the dense projections of a few
// rows (decode), four weight rows and up to TILE token rows per pass, weight rows split between threads.
void dense(uintptr_t x_ptr, uintptr_t weight_ptr, uintptr_t bias_ptr, uintptr_t y_ptr, int64_t n, int64_t in,
           int64_t out, int kind_code, int threads) {
    const auto kind = static_cast<Kind>(kind_code);
    if (kind != Kind::F32 && kind != Kind::BF16) {
        throw pybind11::value_error("dense projections take fp32 or bf16 weights");
    }
    const float* x = reinterpret_cast<const float*>(x_ptr);
    const Matrix weight{reinterpret_cast<const char*>(weight_ptr), kind, in, nullptr};
    const float* bias = reinterpret_cast<const float*>(bias_ptr);
    float* y = reinterpret_cast<float*>(y_ptr);
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t quad = 0; quad < (out + 3) / 4; ++quad) dot::project_quad(weight, out, quad, x, n, y, out, bias);
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

}  // namespace

void register_expert_kernels(pybind11::module_& m) {
    m.def("expert_swiglu", &expert_swiglu, "y = SwiGLU(x) through one expert; raw pointers, see cpu_experts.py");
    m.def("experts_swiglu_sum", &experts_swiglu_sum,
          "y += weighted SwiGLU of several experts over their rows; raw pointers, see cpu_experts.py");
    m.def("pool_finish", &pool_finish, "wait for the background run of experts_swiglu_sum: its seconds");
    m.def("routed_experts", &routed_experts,
          "y = each row's routed experts' weighted SwiGLU sum, grouped here; raw pointers, see cpu_experts.py");
    m.def("moe_block", &moe_block, "a sparse MoE block: router, routed and shared experts; see cpu_experts.py");
    m.def("dense", &dense, "y = x @ weight.T (+ bias) for a few rows; raw pointers, see cpu_experts.py");
    m.def("route", &route, "softmax, top-k and counts of router logits; raw pointers, see cpu_experts.py");
    m.def("set_tables", &set_tables, "the i-quants' lookup tables, once before their first call; see cpu_experts.py");
    m.def("rms_norm", &rms_norm, "RMSNorm of rows (after a residual add, or gated); raw pointers, see cpu_experts.py");
}
