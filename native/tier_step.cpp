// The expert tier's host step for a small window, in one native call: what `TieredExperts._serve_small`
// (app/models/expert_tier.py) does in Python, its reference. A captured decode window stops at each tiered
// layer's cut until this step has read the layer's routing from the host link, chosen which missed experts are
// copied into staging slots and which the CPU pool computes (the costs' `plan` and `share`,
// app/models/expert_costs.py), started the pool's run in the background and queued the copies. Everything the
// step does before the pool's run and the copies begin delays both, and both read the host's memory, which
// bounds the layer: on a GPU machine's host the Python step took about 150 us a layer there, a tenth of a
// decode token's layer with no expert resident. The bookkeeping after (counts, the link's staging map) stays
// in Python (app/models/tier_step.py), off that path.
//
// The copies go through a function of the CUDA driver's `cuMemcpyHtoDAsync` signature whose address the caller
// gives (`host_copy_address`'s plain memcpy on a CPU, for tests), so this file needs no CUDA headers.

#pragma GCC optimize("fp-contract=off")  // the costs' arithmetic as Python's, operation by operation

#include "kernels.h"
#include "pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using CopyFn = int (*)(uint64_t target, const void* source, size_t bytes, void* stream);

int host_copy(uint64_t target, const void* source, size_t bytes, void*) {
    std::memcpy(reinterpret_cast<void*>(target), source, bytes);
    return 0;
}

// The costs of one missed expert on each side (`MissCosts`'s fields).
struct Costs {
    double expert_bytes, pcie_bytes_s, cpu_bytes_s, cpu_row_s, cpu_fixed_s, cpu_call_s;
};

// What does not change between calls: the costs' constants, the layer's shapes, its host and staging weights.
struct Layout {
    int64_t experts, hidden, inter, host_slots, staging_slots, entries;  // entries: the most a call reads
    int64_t gate_up_bytes, down_bytes, row_bytes;  // an expert's gate_up and down; one gate or up row
    uintptr_t host_gate_up, host_down, staging_gate_up, staging_down, copy;
    int kind, down_kind, threads;
    bool splits;  // whether a missed expert may be split between the two sides (plain weights)
    int64_t probe_every, split_align;
    double split_gain_s, gate_up_share;
};

class SmallStep {
public:
    explicit SmallStep(const Layout& layout)
        : l_(layout), count_(static_cast<size_t>(layout.experts), 0), at_(static_cast<size_t>(layout.experts)) {
        if (l_.experts <= 0 || l_.hidden <= 0 || l_.inter <= 0 || l_.entries <= 0 || l_.host_slots <= 0) {
            throw py::value_error("a tier step needs experts, a hidden size, an intermediate size and entries");
        }
        if (l_.staging_slots < 0 || (l_.staging_slots && !l_.copy)) {
            throw py::value_error("staging slots need a copy function");
        }
        hosts_.reserve(l_.experts);
        offsets_.reserve(l_.experts + 1);
        channels_.reserve(l_.experts);
        rows_.resize(l_.entries);
        weights_.resize(l_.entries);
    }

    // One step over `rows` rows of `width` picks: ids then weights as fp32 at picks_ptr (padding rows' ids at
    // least `experts`), x [rows, hidden] fp32 at x_ptr, the pool's sums [rows, hidden] at sums_ptr (its first
    // clear_rows rows zeroed first), each expert's device slot and host slot (int64, -1 for none) at slots_ptr
    // and host_of_ptr, the copies queued on `stream`; with done_ptr the pool's run sets that word once its sums
    // are in. The costs are `MissCosts`'s fields; pcie_frac: NaN, or the share of missed experts forced over
    // PCIe. Returns (entries served from VRAM, over PCIe, by the CPU pool; the experts' worth copied and read by
    // the pool; {expert: staging slot}; whether the pool runs; the whole experts copied; the channels of a split
    // expert the pool sums, 0 for none; the plans since the pool last ran).
    py::tuple serve(uintptr_t picks_ptr, int64_t rows, int64_t width, uintptr_t x_ptr, uintptr_t sums_ptr,
                    int64_t clear_rows, uintptr_t done_ptr, uintptr_t slots_ptr, uintptr_t host_of_ptr,
                    uintptr_t stream, double expert_bytes, double pcie_bytes_s, double cpu_bytes_s,
                    double cpu_row_s, double cpu_fixed_s, double cpu_call_s, int64_t unobserved, double pcie_frac) {
        const Costs costs{expert_bytes, pcie_bytes_s, cpu_bytes_s, cpu_row_s, cpu_fixed_s, cpu_call_s};
        const int64_t entries = rows * width;
        if (rows < 0 || width <= 0 || entries > l_.entries || clear_rows < 0 || clear_rows > l_.entries) {
            throw py::value_error("a tier step reads at most " + std::to_string(l_.entries) + " entries");
        }
        const auto* picks = reinterpret_cast<const float*>(picks_ptr);
        const auto* slots = reinterpret_cast<const int64_t*>(slots_ptr);
        const auto* host_of = reinterpret_cast<const int64_t*>(host_of_ptr);
        if (clear_rows) std::memset(reinterpret_cast<void*>(sums_ptr), 0, clear_rows * l_.hidden * sizeof(float));

        // the missed experts and their entries' counts
        unobserved_ = unobserved;
        int64_t on_device = 0;
        missed_.clear();
        for (int64_t k = 0; k < entries; ++k) {
            const auto expert = static_cast<int64_t>(picks[k]);
            if (expert < 0 || expert >= l_.experts) continue;
            if (slots[expert] >= 0) {
                ++on_device;
            } else if (count_[expert]++ == 0) {
                missed_.push_back(expert);
            }
        }
        py::dict staged;
        if (missed_.empty()) return py::make_tuple(on_device, 0, 0, 0.0, 0.0, staged, false, 0, 0, unobserved);
        std::sort(missed_.begin(), missed_.end(), [this](int64_t a, int64_t b) {
            return count_[a] != count_[b] ? count_[a] > count_[b] : a < b;  // most rows first, then by expert
        });
        missed_rows_.clear();
        for (const int64_t e : missed_) {
            missed_rows_.push_back(count_[e]);
            if (host_of[e] < 0 || host_of[e] >= l_.host_slots) {
                for (const int64_t m : missed_) count_[m] = 0;
                throw py::value_error("a missed expert's host slot must be in [0, " + std::to_string(l_.host_slots) +
                                      ")");
            }
        }
        for (const int64_t e : missed_) count_[e] = 0;

        int64_t whole = 0, split = -1, split_channels = 0;
        if (l_.staging_slots) {
            whole = std::min(plan(costs, pcie_frac), l_.staging_slots);
            split_at(costs, pcie_frac, whole, split, split_channels);
            if (split >= 0) whole = split;
        }
        int64_t pcie_entries = 0;
        for (int64_t i = 0; i < whole; ++i) pcie_entries += missed_rows_[i];
        on_cpu_.assign(missed_.begin() + whole, missed_.end());
        std::sort(on_cpu_.begin(), on_cpu_.end());

        // the CPU pool's share, started first on its own thread
        int64_t cpu_entries = 0;
        double read = 0.0;
        if (!on_cpu_.empty()) {
            cpu_entries = pool_arguments(picks, entries, width, host_of, split >= 0 ? missed_[split] : -1,
                                         split_channels);
            read = static_cast<double>(on_cpu_.size());
            if (split >= 0) read -= 1 - static_cast<double>(split_channels) / static_cast<double>(l_.inter);
            experts_swiglu_sum(x_ptr, l_.host_gate_up, l_.host_down, sums_ptr, 0, 0, l_.hidden, l_.inter, l_.kind,
                               l_.down_kind, l_.threads, reinterpret_cast<uintptr_t>(hosts_.data()),
                               reinterpret_cast<uintptr_t>(offsets_.data()),
                               reinterpret_cast<uintptr_t>(rows_.data()), reinterpret_cast<uintptr_t>(weights_.data()),
                               static_cast<int64_t>(on_cpu_.size()), rows, l_.host_slots, cpu_entries,
                               split >= 0 ? reinterpret_cast<uintptr_t>(channels_.data()) : 0, true, done_ptr);
        }
        // then the copies, while it runs
        double copies = 0.0;
        try {
            copies = queue_copies(whole, split >= 0 ? missed_[split] : -1, split_channels, host_of,
                                  reinterpret_cast<void*>(stream), staged);
        } catch (...) {
            if (!on_cpu_.empty()) pool_finish();
            throw;
        }
        return py::make_tuple(on_device, pcie_entries, cpu_entries, copies, read, staged, !on_cpu_.empty(), whole,
                              split_channels, unobserved_);
    }

private:
    // `MissCosts.plan`: how many of the missed experts (most rows first) go over PCIe whole.
    int64_t plan(const Costs& c, double pcie_frac) {
        const auto n = static_cast<int64_t>(missed_rows_.size());
        if (!std::isnan(pcie_frac)) return std::min(static_cast<int64_t>(std::nearbyint(pcie_frac * n)), n);
        const double base = c.expert_bytes / c.cpu_bytes_s, per_row = c.cpu_row_s;
        const double copy = c.expert_bytes / c.pcie_bytes_s;
        int64_t total = 0;
        for (const int64_t r : missed_rows_) total += r;
        double cpu_left = base * static_cast<double>(n) + per_row * static_cast<double>(total - n);
        int64_t best = 0;
        double best_s = c.cpu_call_s + cpu_left;
        for (int64_t taken = 1; taken <= n; ++taken) {
            cpu_left -= base + per_row * static_cast<double>(missed_rows_[taken - 1] - 1);
            const double seconds =
                std::max(static_cast<double>(taken) * copy, cpu_left + (taken < n ? c.cpu_call_s : 0.0));
            if (seconds < best_s) {
                best = taken;
                best_s = seconds;
            }
        }
        if (best == n && n > 1) {
            if (++unobserved_ >= l_.probe_every) {
                unobserved_ = 0;
                return best - 1;
            }
        }
        return best;
    }

    // `TieredExperts._split_at` with `MissCosts.share`: the missed expert split between the two sides, if any
    // (its index among the missed and the channels the CPU pool sums), given `copied` copied whole.
    void split_at(const Costs& c, double pcie_frac, int64_t copied, int64_t& split, int64_t& channels) const {
        split = -1;
        channels = 0;
        if (!l_.splits || !std::isnan(pcie_frac)) return;
        const auto n = static_cast<int64_t>(missed_rows_.size());
        const double base = c.expert_bytes / c.cpu_bytes_s, per_row = c.cpu_row_s;
        const double copy = c.expert_bytes / c.pcie_bytes_s, call = c.cpu_call_s;
        int64_t rest = 0;
        for (int64_t i = copied; i < n; ++i) rest += missed_rows_[i];
        const double left =
            base * static_cast<double>(n - copied) + per_row * static_cast<double>(rest - n + copied);
        double best_s =
            std::max(static_cast<double>(copied) * copy, left + (copied < n ? call : 0.0)) - l_.split_gain_s;
        int64_t best = -1;
        double best_f = 0.0;
        for (const int64_t at : {copied - 1, copied}) {
            if (at < 0 || at >= n) continue;
            const double own = base + per_row * static_cast<double>(missed_rows_[at] - 1);
            const double before = static_cast<double>(at) * copy;
            const double after = call + left - (at == copied ? own : 0.0);
            const double fixed = std::min(c.cpu_fixed_s, own);
            const double f = (before + copy - after - fixed) / (own - fixed + l_.gate_up_share * copy);
            const double seconds = before + copy * (1 - l_.gate_up_share * f);
            if (0 < f && f < 1 && seconds < best_s) {
                best = at;
                best_f = f;
                best_s = seconds;
            }
        }
        if (best < 0 || best >= l_.staging_slots) return;
        const auto kept = static_cast<int64_t>(
            std::nearbyint(best_f * static_cast<double>(l_.inter) / static_cast<double>(l_.split_align)));
        const int64_t aligned = kept * l_.split_align;
        if (0 < aligned && aligned < l_.inter) {
            split = best;
            channels = aligned;
        }
    }

    // The pool's arguments for the experts of on_cpu_: host slots, bounds, each entry's row and weight, and
    // with a split expert every expert's channels. Returns the entries.
    int64_t pool_arguments(const float* picks, int64_t entries, int64_t width, const int64_t* host_of,
                           int64_t split_expert, int64_t split_channels) {
        hosts_.clear();
        channels_.clear();
        offsets_.assign(on_cpu_.size() + 1, 0);
        for (size_t i = 0; i < on_cpu_.size(); ++i) {
            const int64_t e = on_cpu_[i];
            at_[e] = static_cast<int64_t>(i);
            hosts_.push_back(host_of[e]);
            count_[e] = 1;  // marks the pool's experts until the end of this call
        }
        // entries placed expert by expert in entry order: a count per expert, then their starts
        for (int64_t k = 0; k < entries; ++k) {
            const auto e = static_cast<int64_t>(picks[k]);
            if (e >= 0 && e < l_.experts && count_[e]) ++offsets_[at_[e] + 1];
        }
        for (size_t i = 0; i < on_cpu_.size(); ++i) offsets_[i + 1] += offsets_[i];
        fill_.assign(offsets_.begin(), offsets_.end() - 1);
        for (int64_t k = 0; k < entries; ++k) {
            const auto e = static_cast<int64_t>(picks[k]);
            if (e < 0 || e >= l_.experts || !count_[e]) continue;
            const int64_t to = fill_[at_[e]]++;
            rows_[to] = k / width;
            weights_[to] = picks[entries + k];
        }
        for (const int64_t e : on_cpu_) {
            count_[e] = 0;
            if (split_expert >= 0) channels_.push_back(e == split_expert ? split_channels : l_.inter);
        }
        return offsets_.back();
    }

    // `ExpertStaging.load` of the first `whole` missed experts and, with split_expert, `load_rest` of it; the
    // slots into `staged`. Returns the experts' worth of bytes copied.
    double queue_copies(int64_t whole, int64_t split_expert, int64_t split_channels, const int64_t* host_of,
                        void* stream, const py::dict& staged) {
        if (!whole && split_expert < 0) return 0.0;
        const auto copy = reinterpret_cast<CopyFn>(l_.copy);
        const auto run = [&](uintptr_t target, uintptr_t source, int64_t bytes) {
            const int result = copy(static_cast<uint64_t>(target), reinterpret_cast<const void*>(source),
                                    static_cast<size_t>(bytes), stream);
            if (result) {
                throw std::runtime_error("queueing a host-to-device copy failed (CUDA driver error " +
                                         std::to_string(result) + ")");
            }
        };
        order_.clear();
        for (int64_t i = 0; i < whole; ++i) order_.emplace_back(host_of[missed_[i]], missed_[i]);
        std::sort(order_.begin(), order_.end());
        // runs of consecutive host slots as one copy each, gate_up's then down's
        for (const auto& [target, source, size] : {std::make_tuple(l_.staging_gate_up, l_.host_gate_up, l_.gate_up_bytes),
                                                  std::make_tuple(l_.staging_down, l_.host_down, l_.down_bytes)}) {
            for (size_t start = 0; start < order_.size();) {
                size_t end = start + 1;
                while (end < order_.size() && order_[end].first == order_[end - 1].first + 1) ++end;
                run(target + start * size, source + order_[start].first * size,
                    static_cast<int64_t>(end - start) * size);
                start = end;
            }
        }
        for (size_t slot = 0; slot < order_.size(); ++slot) staged[py::int_(order_[slot].second)] = slot;
        double copies = static_cast<double>(whole);
        if (split_expert >= 0) {
            // its gate and up rows from channel split_channels on, and its whole down matrix, into the last slot
            const int64_t slot = l_.staging_slots - 1, host = host_of[split_expert];
            const int64_t kept = (l_.inter - split_channels) * l_.row_bytes;
            for (const int64_t first : {int64_t{0}, l_.inter}) {
                const int64_t offset = (first + split_channels) * l_.row_bytes;
                run(l_.staging_gate_up + slot * l_.gate_up_bytes + offset,
                    l_.host_gate_up + host * l_.gate_up_bytes + offset, kept);
            }
            run(l_.staging_down + slot * l_.down_bytes, l_.host_down + host * l_.down_bytes, l_.down_bytes);
            staged[py::int_(split_expert)] = slot;
            copies += 1 - l_.gate_up_share * static_cast<double>(split_channels) / static_cast<double>(l_.inter);
        }
        return copies;
    }

    Layout l_;
    std::vector<int64_t> count_;  // entries a missed expert took this call (zero between calls)
    std::vector<int64_t> at_;     // an expert's place among the pool's experts
    // the missed experts (most rows first) and their rows; the pool's experts; where each's next entry goes
    std::vector<int64_t> missed_, missed_rows_, on_cpu_, fill_;
    std::vector<std::pair<int64_t, int64_t>> order_;  // (host slot, expert) of the experts copied whole
    // the pool's arguments, read by its background run: kept until the next call, which comes after its end
    std::vector<int64_t> hosts_, offsets_, rows_, channels_;
    std::vector<float> weights_;
    int64_t unobserved_ = 0;
};

}  // namespace

void register_tier_step(py::module_& m) {
    py::class_<SmallStep>(m, "SmallStep")
        .def(py::init([](int64_t experts, int64_t hidden, int64_t inter, int64_t host_slots, int64_t staging_slots,
                         int64_t entries, int64_t gate_up_bytes, int64_t down_bytes, int64_t row_bytes,
                         uintptr_t host_gate_up, uintptr_t host_down, uintptr_t staging_gate_up,
                         uintptr_t staging_down, uintptr_t copy, int kind, int down_kind, int threads, bool splits,
                         int64_t probe_every, int64_t split_align, double split_gain_s, double gate_up_share) {
                 return new SmallStep(Layout{experts, hidden, inter, host_slots, staging_slots, entries,
                                             gate_up_bytes, down_bytes, row_bytes, host_gate_up, host_down,
                                             staging_gate_up, staging_down, copy, kind, down_kind, threads, splits,
                                             probe_every, split_align, split_gain_s, gate_up_share});
             }))
        .def("serve", &SmallStep::serve, "one small window's host step at a tiered layer; see app/models/tier_step.py");
    m.def("host_copy_address", [] { return reinterpret_cast<uintptr_t>(&host_copy); },
          "a copy function of the driver's signature that copies host memory (a tier step's copies on a CPU)");
}
