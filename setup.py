"""Build script: runs the one CMake build of ep_backend and places `ep_backend._C`.

Install against the torch already in the environment (never an isolated build env):

    pip install --no-build-isolation .          # or -e . for development

Environment:
    EP_WITH_CUDA=auto|0|1   auto (default) builds the CUDA parts where nvcc and a CUDA torch exist.
    EP_CUDA_ARCH=90a        CUDA architectures of the kernels.
    EP_BUILD_DIR=path       keep the CMake build tree there (reused by later builds).
    MAX_JOBS=N              parallel compile jobs.
    EP_CMAKE_ARGS="..."     extra CMake arguments (e.g. -DCUDA_TOOLKIT_ROOT_DIR=/usr/local/cuda).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _cuda_wanted() -> bool:
    mode = os.environ.get("EP_WITH_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    has_nvcc = (
        shutil.which("nvcc") is not None
        or Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc").exists()
    )
    try:
        import torch

        torch_has_cuda = torch.version.cuda is not None
    except ImportError:
        torch_has_cuda = False
    if mode in ("1", "on", "true", "yes"):
        if not (has_nvcc and torch_has_cuda):
            raise RuntimeError(
                "EP_WITH_CUDA=1 needs nvcc and a CUDA build of torch "
                f"(nvcc found: {has_nvcc}, torch CUDA: {torch_has_cuda})"
            )
        return True
    return has_nvcc and torch_has_cuda


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        with_cuda = _cuda_wanted()
        build_dir = Path(os.environ.get("EP_BUILD_DIR", Path(self.build_temp) / "cmake")).resolve()
        build_dir.mkdir(parents=True, exist_ok=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        cfg = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DEP_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            f"-DEP_CUDA_ARCHITECTURES={os.environ.get('EP_CUDA_ARCH', '90a')}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        cfg += os.environ.get("EP_CMAKE_ARGS", "").split()
        if shutil.which("ninja"):
            cfg += ["-G", "Ninja"]
        if with_cuda and not os.environ.get("CUDACXX"):
            nvcc = shutil.which("nvcc") or str(
                Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
            )
            cfg.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        print(f"[ep_backend] CUDA build: {with_cuda}; build dir {build_dir}", flush=True)
        cache = build_dir / "CMakeCache.txt"
        if cache.exists() and f"EP_WITH_CUDA:BOOL={'ON' if with_cuda else 'OFF'}" not in (
            cache.read_text()
        ):
            cache.unlink()  # switching CUDA on/off needs a fresh configure
        subprocess.run(cfg, check=True)
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs], check=True
        )
        built = sorted(build_dir.glob("_C*.so"))
        if not built:
            raise RuntimeError(f"CMake produced no _C module in {build_dir}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[0], dest)
        if with_cuda:
            targets = [dest.parent]
            if getattr(self, "editable_mode", False):
                # An editable install copies only the extension module into the source tree;
                # the library _C loads from beside itself must land there too.
                targets.append(ROOT / "ep_backend")
            self._build_low_latency_library(build_dir, jobs, targets)

    @staticmethod
    def _build_low_latency_library(build_dir: Path, jobs: str, package_dirs: list[Path]) -> None:
        """libep_nvshmem.so (NVSHMEM low-latency kernels), loaded by _C at run time when present.

        Optional: where NVSHMEM is missing or the library does not build, the low-latency ops run
        on the ATen path and the rest of ep_backend is unaffected.
        """
        for package_dir in package_dirs:  # never load a stale one
            (package_dir / "libep_nvshmem.so").unlink(missing_ok=True)
        result = subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "ep_nvshmem", "-j", jobs],
            capture_output=True, text=True,
        )  # fmt: skip
        built = sorted(build_dir.glob("libep_nvshmem.so"))
        if result.returncode != 0 or not built:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            print(f"[ep_backend] WARNING: libep_nvshmem.so not built; low-latency ops will use "
                  f"the ATen path.\n{tail}", flush=True)  # fmt: skip
            return
        for package_dir in package_dirs:
            shutil.copy2(built[0], package_dir / built[0].name)
            print(f"[ep_backend] built {package_dir / built[0].name}", flush=True)


setup(ext_modules=[CMakeExtension("ep_backend._C")], cmdclass={"build_ext": CMakeBuild})
