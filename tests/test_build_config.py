"""The build's choices (setup.py): CUDA toolkit discovery, CPU fallback reasons, architectures."""

from __future__ import annotations

import importlib.util
import os
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ep_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


setup_py = _load_setup()


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _fake_toolkit(root: Path, release: str = "13.0") -> Path:
    """A toolkit folder whose nvcc answers --version and --dryrun as the real one does."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("")
    _script(
        root / "bin" / "nvcc",
        f'case "$1" in --version) echo "Cuda compilation tools, release {release}, V{release}.1";;\n'
        f'--dryrun) echo "#$ _HERE_={root}/bin" >&2;; esac\n',
    )
    return root


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("CUDA_HOME", "CUDA_PATH", "EP_CUDA_ARCH", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}:/usr/bin:/bin")
    monkeypatch.setattr(setup_py, "Path", _NoUsrLocalCuda)
    return tmp_path


class _NoUsrLocalCuda(type(Path())):  # type: ignore[misc]
    """Path, except that /usr/local/cuda does not exist (the test machine may have one)."""

    def exists(self, *args: object, **kwargs: object) -> bool:
        if str(self).startswith("/usr/local/cuda"):
            return False
        return super().exists()


def test_toolkit_found_through_a_wrapper_script_outside_it(clean_env: Path, monkeypatch) -> None:
    toolkit = _fake_toolkit(clean_env / "cuda-13.0")
    # As on the CI machine: PATH has a small script that execs the real nvcc.
    wrapper_dir = clean_env / "wrappers"
    _script(wrapper_dir / "nvcc", f'exec {toolkit}/bin/nvcc "$@"\n')
    monkeypatch.setenv("PATH", f"{wrapper_dir}:{os.environ['PATH']}")
    home, where = setup_py.find_cuda_home()
    assert home == toolkit
    assert "nvcc on PATH" in where


def test_cuda_home_wins_over_path(clean_env: Path, monkeypatch) -> None:
    first = _fake_toolkit(clean_env / "a")
    second = _fake_toolkit(clean_env / "b")
    monkeypatch.setenv("CUDA_HOME", str(first))
    monkeypatch.setenv("PATH", f"{second / 'bin'}:{os.environ['PATH']}")
    assert setup_py.find_cuda_home()[0] == first


def test_no_nvcc_means_a_cpu_build_with_the_reason(clean_env: Path) -> None:
    info = setup_py.TorchInfo(version="2.14.1", cuda="13.0")
    home, why = setup_py._cuda_plan(info)
    assert home is None
    assert "no nvcc found" in why


def test_cpu_torch_means_a_cpu_build_with_the_reason(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(_fake_toolkit(clean_env / "cuda")))
    home, why = setup_py._cuda_plan(setup_py.TorchInfo(version="2.13.0", cuda=None))
    assert home is None
    assert why == "torch 2.13.0 is a CPU build"


def test_nvcc_major_must_match_torch_cuda(clean_env: Path, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_HOME", str(_fake_toolkit(clean_env / "cuda", release="12.8")))
    home, why = setup_py._cuda_plan(setup_py.TorchInfo(version="2.14.1", cuda="13.0"))
    assert home is None
    assert "nvcc 12.8" in why and "13.0" in why
    monkeypatch.setenv("CUDA_HOME", str(_fake_toolkit(clean_env / "cuda13", release="13.2")))
    home, why = setup_py._cuda_plan(setup_py.TorchInfo(version="2.14.1", cuda="13.0"))
    assert home == clean_env / "cuda13" and why == ""


@pytest.mark.parametrize(
    ("torch_list", "expected"),
    [
        ("9.0a", "90a"),
        ("9.0", "90a"),
        ("9.0a 10.0a", "90a;100a"),
        ("8.0;9.0+PTX", "90a-real;90-virtual"),
        ("10.0f", "100f"),
    ],
)
def test_architectures_follow_torch_cuda_arch_list(
    clean_env: Path, monkeypatch, torch_list: str, expected: str
) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", torch_list)
    assert setup_py.cuda_architectures() == expected


def test_architectures_default_and_override(clean_env: Path, monkeypatch) -> None:
    assert setup_py.cuda_architectures() == "90a;100a"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("EP_CUDA_ARCH", "100a")
    assert setup_py.cuda_architectures() == "100a"


@pytest.mark.parametrize("torch_list", ["8.0 8.6", "sm_90"])
def test_unusable_arch_lists_are_refused(clean_env: Path, monkeypatch, torch_list: str) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", torch_list)
    with pytest.raises(RuntimeError, match="TORCH_CUDA_ARCH_LIST"):
        setup_py.cuda_architectures()


@pytest.mark.parametrize(("editable", "in_source"), [(False, False), (True, True)])
def test_low_latency_library_goes_beside_every_importable_c_module(
    tmp_path: Path, editable: bool, in_source: bool
) -> None:
    command = setup_py.CMakeBuild.__new__(setup_py.CMakeBuild)  # no distribution needed
    command.editable_mode = editable
    built = tmp_path / "build" / "lib" / "ep_backend"
    dirs = command._package_dirs(built)
    assert dirs[0] == built
    assert (ROOT / "ep_backend" in dirs) == in_source


def test_in_place_build_copies_the_low_latency_library(tmp_path: Path, monkeypatch) -> None:
    """setuptools builds `--inplace` into build_lib with `inplace` off, then copies only the
    extension modules: the library must follow them (a stale one is removed when none was built)."""
    source_pkg = tmp_path / "src" / "ep_backend"
    source_pkg.mkdir(parents=True)
    build_pkg = tmp_path / "build" / "ep_backend"
    build_pkg.mkdir(parents=True)
    monkeypatch.setattr(setup_py, "ROOT", tmp_path / "src")
    monkeypatch.setattr(setup_py.build_ext, "copy_extensions_to_source", lambda self: None)
    command = setup_py.CMakeBuild.__new__(setup_py.CMakeBuild)
    command.build_lib = str(tmp_path / "build")
    (source_pkg / "libep_nvshmem.so").write_bytes(b"stale")
    command.copy_extensions_to_source()
    assert not (source_pkg / "libep_nvshmem.so").exists()
    (build_pkg / "libep_nvshmem.so").write_bytes(b"new")
    command.copy_extensions_to_source()
    assert (source_pkg / "libep_nvshmem.so").read_bytes() == b"new"
