// The CPU expert pool's entry points that other native parts call as well as Python (native/cpu_experts.cpp
// says what each argument is): the expert tier's small-window host step (native/tier_step.cpp) starts a
// window's pool run with them.
#pragma once

#include <cstdint>

void experts_swiglu_sum(uintptr_t x_ptr, uintptr_t gate_up_ptr, uintptr_t down_ptr, uintptr_t y_ptr,
                        uintptr_t gate_up_scales_ptr, uintptr_t down_scales_ptr, int64_t hidden, int64_t inter,
                        int kind_code, int down_kind_code, int threads, uintptr_t experts_ptr,
                        uintptr_t offsets_ptr, uintptr_t rows_ptr, uintptr_t weights_ptr, int64_t count, int64_t n,
                        int64_t total, int64_t entries, uintptr_t channels_ptr, bool background,
                        uintptr_t done_ptr);

// Wait for the background run experts_swiglu_sum started; the seconds it took on the pool's thread.
double pool_finish();
