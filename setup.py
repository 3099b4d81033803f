"""Build script: runs the one CMake build of ep_backend and places `ep_backend._C`.

Install against the torch already in the environment (never an isolated build env):

    pip install --no-build-isolation .          # or -e . for development

The CUDA build is chosen as torch's own `cpp_extension` would find a toolkit: a CUDA build of
torch, plus an `nvcc` from `CUDA_HOME` / `CUDA_PATH`, the `nvcc` on PATH (through any wrapper
script, asking nvcc where it lives) or `/usr/local/cuda`, whose major version matches torch's.
Where any of that is missing, or the CUDA configure fails, `EP_WITH_CUDA=auto` builds the CPU
package instead and says why in one line. A GPU is not needed to build.

Environment (docs/configuration.md lists every variable):
    EP_WITH_CUDA=auto|0|1   auto (default): CUDA where it can be built, else CPU; 1: CUDA or fail.
    EP_CUDA_ARCH="90a;100a" CUDA architectures of the kernels (default: from TORCH_CUDA_ARCH_LIST
                            when that is set, else 90a;100a).
    EP_BUILD_DIR=path       the CMake build tree (default build/<python>-<torch>-<cpu|cuda>/ in
                            this checkout, kept between builds, so rebuilds are incremental).
    MAX_JOBS=N              parallel compile jobs (default: the CPU count).
    EP_CMAKE_ARGS="..."     extra CMake arguments.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCH = "90a;100a"


def _say(line: str) -> None:
    print(f"[ep_backend] {line}", flush=True)


@dataclass
class TorchInfo:
    version: str
    cuda: str | None  # torch.version.cuda, e.g. "13.0"; None for a CPU torch


def _torch_info() -> TorchInfo:
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            "ep_backend builds against the installed torch: pip install torch first, then "
            "pip install --no-build-isolation ."
        ) from e
    return TorchInfo(version=torch.__version__.split("+")[0], cuda=torch.version.cuda)


def _nvcc_home(nvcc: Path) -> Path | None:
    """The toolkit root of an nvcc, also when `nvcc` is a wrapper script outside the toolkit."""
    real = nvcc.resolve()
    if (real.parent.parent / "include" / "cuda_runtime.h").exists():
        return real.parent.parent
    try:  # a wrapper: nvcc's dry run prints the folder it really runs from
        out = subprocess.run(
            [str(nvcc), "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
            capture_output=True, text=True, timeout=60,
        ).stderr  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", out, re.MULTILINE)
    if match:
        home = Path(match.group(1).strip()).parent
        if (home / "include" / "cuda_runtime.h").exists():
            return home
    return None


def find_cuda_home() -> tuple[Path | None, str]:
    """The CUDA toolkit to build with, or None and why not."""
    candidates: list[tuple[str, Path]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append((f"${var}", Path(os.environ[var]) / "bin" / "nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(("nvcc on PATH", Path(on_path)))
    candidates.append(("/usr/local/cuda", Path("/usr/local/cuda/bin/nvcc")))
    for origin, nvcc in candidates:
        if nvcc.exists():
            home = _nvcc_home(nvcc)
            if home is not None:
                return home, f"{home} (from {origin})"
    return None, "no nvcc found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"


def _nvcc_version(home: Path) -> str | None:
    try:
        out = subprocess.run(
            [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def _cuda_plan(torch_info: TorchInfo) -> tuple[Path | None, str]:
    """(toolkit, "") when a CUDA build should be made; (None, why not) otherwise."""
    if torch_info.cuda is None:
        return None, f"torch {torch_info.version} is a CPU build"
    home, where = find_cuda_home()
    if home is None:
        return None, where
    nvcc_version = _nvcc_version(home)
    if nvcc_version is None:
        return None, f"nvcc in {home} did not report its version"
    if nvcc_version.split(".")[0] != torch_info.cuda.split(".")[0]:
        return None, f"nvcc {nvcc_version} ({home}) does not match torch's CUDA {torch_info.cuda}"
    return home, ""


def cuda_architectures() -> str:
    """CMake's CUDA architecture list: EP_CUDA_ARCH, else torch's TORCH_CUDA_ARCH_LIST, else both
    Hopper and Blackwell. TORCH_CUDA_ARCH_LIST is read as cpp_extension reads it ("9.0a 10.0a",
    ";"-separated too, "+PTX" adds PTX); names without an "a" suffix get one where the kernels
    need the architecture-specific features (sm_90a, sm_100a)."""
    if os.environ.get("EP_CUDA_ARCH"):
        return os.environ["EP_CUDA_ARCH"]
    torch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not torch_list:
        return DEFAULT_CUDA_ARCH
    archs: list[str] = []
    for item in re.split(r"[;\s]+", torch_list):
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", item)
        if not match:
            raise RuntimeError(
                f"TORCH_CUDA_ARCH_LIST: cannot read {item!r} (use e.g. '9.0a 10.0a')"
            )
        major, minor, suffix, ptx = match.groups()
        if int(major) < 9:
            continue  # the kernels need Hopper or newer; older GPUs use the ATen path
        name = f"{major}{minor}{suffix or 'a'}"
        archs.append(name if not ptx else f"{name}-real;{major}{minor}-virtual")
    if not archs:
        raise RuntimeError(f"TORCH_CUDA_ARCH_LIST={torch_list!r} names no Hopper-or-newer GPU")
    return ";".join(archs)


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        mode = os.environ.get("EP_WITH_CUDA", "auto").strip().lower()
        if mode not in ("auto", "0", "1", "on", "off", "true", "false", "yes", "no"):
            raise RuntimeError(f"EP_WITH_CUDA={mode!r}: use auto, 0 or 1")
        torch_info = _torch_info()
        cuda_home: Path | None = None
        cpu_reason = ""  # why this is a CPU build ("" for a CUDA one)
        if mode in ("0", "off", "false", "no"):
            cpu_reason = "EP_WITH_CUDA=0"
            _say("building the CPU package (EP_WITH_CUDA=0)")
        else:
            cuda_home, cpu_reason = _cuda_plan(torch_info)
            if cuda_home is None:
                if mode != "auto":
                    raise RuntimeError(
                        f"EP_WITH_CUDA=1 but no CUDA build can be made: {cpu_reason}"
                    )
                _say(f"building the CPU package: {cpu_reason}")
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
        if cuda_home is not None:
            try:
                build_dir = self._build(torch_info, cuda_home, jobs, "")
            except _BuildStepFailed as e:
                if mode != "auto":
                    raise
                cpu_reason = f"the CUDA build failed ({e.output_tail})"
                _say(f"building the CPU package: {cpu_reason}")
                cuda_home = None
        if cuda_home is None:
            build_dir = self._build(torch_info, None, jobs, cpu_reason)
        self._install(ext, build_dir, cuda_home is not None, jobs)

    def _build_dir(self, torch_info: TorchInfo, with_cuda: bool) -> Path:
        if os.environ.get("EP_BUILD_DIR"):
            return Path(os.environ["EP_BUILD_DIR"]).resolve()
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch_info.version}"
        return ROOT / "build" / f"{tag}-{'cuda' if with_cuda else 'cpu'}"

    def _build(
        self, torch_info: TorchInfo, cuda_home: Path | None, jobs: str, cpu_reason: str
    ) -> Path:
        with_cuda = cuda_home is not None
        build_dir = self._build_dir(torch_info, with_cuda)
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DEP_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]  # fmt: skip
        if with_cuda:
            arch = cuda_architectures()
            cfg += [
                f"-DEP_CUDA_ARCHITECTURES={arch}",
                f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}",
                f"-DCUDAToolkit_ROOT={cuda_home}",
            ]
        # Why this is a CPU build, kept in _C (pip hides the build's output): the bench says it.
        note = re.sub(r"[^A-Za-z0-9 ._:/()=+,-]", "", cpu_reason)[:300]
        cfg.append(f"-DEP_CPU_BUILD_REASON={note}")
        cfg += os.environ.get("EP_CMAKE_ARGS", "").split()
        if shutil.which("ninja") and not (build_dir / "Makefile").exists():
            cfg += ["-G", "Ninja"]
        _say(f"CUDA build: {with_cuda}; build dir {build_dir}")
        _run(cfg)
        _run(["cmake", "--build", str(build_dir), "--target", "_C", "-j", jobs])
        return build_dir

    def _install(self, ext: Extension, build_dir: Path, with_cuda: bool, jobs: str) -> None:
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        built = build_dir / f"_C{suffix}"
        if not built.exists():
            raise RuntimeError(f"CMake produced no {built.name} in {build_dir}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest)
        targets = self._package_dirs(dest.parent)
        for package_dir in targets:  # never load a stale low-latency library
            (package_dir / "libep_nvshmem.so").unlink(missing_ok=True)
        if with_cuda:
            self._build_low_latency_library(build_dir, jobs, targets)

    def _package_dirs(self, built_package: Path) -> list[Path]:
        """Where libep_nvshmem.so goes: beside every copy of _C that can be imported.

        An editable install (`pip install -e`) copies only the extension module from the build
        folder into the source tree; the library _C loads from beside itself must land there
        too. (`build_ext --inplace` builds into the build folder too, with `inplace` off, and
        copies afterwards: `copy_extensions_to_source` below.)
        """
        targets = [built_package]
        source_package = ROOT / "ep_backend"
        if (
            getattr(self, "editable_mode", False)
            and source_package.resolve() != built_package.resolve()
        ):
            targets.append(source_package)
        return targets

    def copy_extensions_to_source(self) -> None:
        """`build_ext --inplace`: the low-latency library goes to the source tree with _C."""
        super().copy_extensions_to_source()
        source = ROOT / "ep_backend" / "libep_nvshmem.so"
        built = Path(self.build_lib) / "ep_backend" / "libep_nvshmem.so"
        if built.resolve() == source.resolve():
            return
        source.unlink(missing_ok=True)  # never load a stale one beside a new _C
        if built.exists():
            shutil.copy2(built, source)
            _say(f"copied {built.name} to {source.parent}")

    @staticmethod
    def _build_low_latency_library(build_dir: Path, jobs: str, package_dirs: list[Path]) -> None:
        """libep_nvshmem.so (NVSHMEM low-latency kernels), loaded by _C at run time when present.

        Optional: where NVSHMEM is missing or the library does not build, the low-latency ops run
        on the ATen path and the rest of ep_backend is unaffected.
        """
        result = subprocess.run(
            ["cmake", "--build", str(build_dir), "--target", "ep_nvshmem", "-j", jobs],
            capture_output=True, text=True,
        )  # fmt: skip
        built = build_dir / "libep_nvshmem.so"
        if result.returncode != 0 or not built.exists():
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-15:])
            _say(
                f"WARNING: libep_nvshmem.so not built; low-latency ops will use the ATen path.\n{tail}"
            )
            return
        for package_dir in package_dirs:
            shutil.copy2(built, package_dir / built.name)
            _say(f"built {package_dir / built.name}")


class _BuildStepFailed(subprocess.CalledProcessError):
    """A CMake step that failed; `output_tail` is its last error line, for a one-line message."""

    output_tail: str


def _run(cmd: list[str]) -> None:
    """Runs a CMake step, echoing its output; on failure raises with the step's last error line."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line.rstrip())
    if proc.wait() != 0:
        err = _BuildStepFailed(proc.returncode, cmd)
        errors = [ln.strip() for ln in lines if "error" in ln.lower() and ln.strip()]
        err.output_tail = (errors or [ln for ln in lines if ln.strip()] or ["no output"])[-1]
        raise err


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers
    setup(ext_modules=[CMakeExtension("ep_backend._C")], cmdclass={"build_ext": CMakeBuild})
