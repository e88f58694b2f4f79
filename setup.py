"""The native CPU kernels (native/), built at install time for this machine's CPU.

Optional: where no C++ compiler or OpenMP exists the install goes on without it: the CPU expert pool runs its
torch fallback (app/kernels/cpu_experts.py says so once) and the CPU backend set is the torch reference.
Everything else is in pyproject.toml.
"""

import pybind11
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "app.kernels._native",
            ["native/module.cpp", "native/cpu_experts.cpp", "native/cpu_sequence.cpp"],
            include_dirs=[pybind11.get_include()],
            language="c++",
            extra_compile_args=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
