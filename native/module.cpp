// The native CPU kernels as one Python module, app.kernels._native.
#include "kernels.h"

PYBIND11_MODULE(_native, m) {
    m.doc() = "Strata's native CPU kernels: routed experts, dense rows, router, norms and sequence mixers.";
    register_expert_kernels(m);
    register_sequence_kernels(m);
}
