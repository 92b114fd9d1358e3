"""Builds the fusedmha Python package by driving CMake (CMakeLists.txt is the one
description of the sources). Build against the torch you have installed:

    pip install --no-build-isolation .

Environment: FUSEDMHA_CUDA=auto|0|1 (CUDA kernels), MAX_JOBS (parallel compile jobs),
FUSEDMHA_BUILD_DIR (the CMake build tree; default build/release, which tests/run.sh builds
its tests in too, so the library's objects are compiled once for both).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MIN_TORCH = (2, 4)


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(FusedMHA VERSION ([0-9.]+)", text).group(1)


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            import torch
            import torch.utils
        except ImportError:
            sys.exit("fusedmha builds against an installed torch: pip install torch, then "
                     "pip install --no-build-isolation .")
        version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        if version < MIN_TORCH:
            sys.exit(f"fusedmha needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}")

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One build tree for the package and the test suite (tests/run.sh configures the
        # same tree with the tests on): the second build compiles only what the first lacked.
        build_dir = Path(os.environ.get("FUSEDMHA_BUILD_DIR", ROOT / "build" / "release")).resolve()
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DFUSEDMHA_PYTHON_OUTPUT_DIR={out_dir}",
            f"-DFUSEDMHA_CUDA={os.environ.get('FUSEDMHA_CUDA', 'auto')}",
            "-DFUSEDMHA_BUILD_PYTHON=ON",
            "-DFUSEDMHA_BUILD_TESTS=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", jobs])


setup(
    version=project_version(),
    package_dir={"": "python"},
    packages=["fusedmha", "fusedmha.integrations"],
    ext_modules=[Extension("fusedmha._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
