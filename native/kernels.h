// The native module's parts: each source file registers its kernels with the module (native/module.cpp).
#pragma once

#include <pybind11/pybind11.h>

void register_expert_kernels(pybind11::module_& m);    // native/cpu_experts.cpp
void register_sequence_kernels(pybind11::module_& m);  // native/cpu_sequence.cpp
void register_tier_step(pybind11::module_& m);         // native/tier_step.cpp
