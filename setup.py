"""The native CPU kernels (native/), built at install time for this machine's CPU, the pages' templates and
static files, copied into the webui package of a build, and the CUDA kernels' source, copied beside its
module.

The native kernels are optional: where no C++ compiler or OpenMP exists the install goes on without them (and
STRATA_NO_NATIVE=1 skips them): the CPU expert pool runs its torch fallback (app/kernels/cpu_experts.py says
so once) and the CPU backend set is the torch reference. Everything else is in pyproject.toml.
"""

import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

PAGE_FILES = ("templates", "static")  # the repository's top-level directories the pages read


class BuildWithPages(build_py):
    """build_py that also copies templates/ and static/ into the built webui package, and the CUDA kernels'
    source (native/*.cu, compiled on the device at first use: app/kernels/cuda_held.py) beside its module."""

    def run(self) -> None:
        super().run()
        root = Path(__file__).parent
        for name in PAGE_FILES:
            target = Path(self.build_lib) / "webui" / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(root / name, target)
        for source in (root / "native").glob("*.cu"):
            shutil.copy(source, Path(self.build_lib) / "app" / "kernels" / source.name)


def native_kernels() -> list[Extension]:
    if os.environ.get("STRATA_NO_NATIVE") == "1":
        return []
    import pybind11

    return [
        Extension(
            "app.kernels._native",
            [f"native/{name}.cpp" for name in ("module", "cpu_experts", "cpu_sequence", "tier_step")],
            include_dirs=[pybind11.get_include()],
            language="c++",
            extra_compile_args=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]


setup(ext_modules=native_kernels(), cmdclass={"build_py": BuildWithPages})
