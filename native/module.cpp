// The native CPU kernels as one Python module, app.kernels._native.
#include "kernels.h"

PYBIND11_MODULE(_native, m) {
    m.doc() =
        "Strata's native CPU kernels: routed experts, dense rows, router, norms, sequence mixers, and the expert "
        "tier's host step.";
    register_expert_kernels(m);
    register_sequence_kernels(m);
    register_tier_step(m);
}
