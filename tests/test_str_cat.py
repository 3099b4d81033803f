"""``native/common/str_cat.hpp``: the message builder of the runtimes in libep_nvshmem.so (which
use no iostreams), compiled here with the host C++ compiler and checked against the text an
ostream would have printed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[1] / "native"

PROGRAM = r"""
#include <cstdint>
#include <cstdio>
#include <limits>
#include "common/str_cat.hpp"

struct Record { int code; int rank; long long value_a; };

int main() {
  using ep::runtime::Hex;
  using ep::runtime::strCat;
  volatile Record r{3, -1, std::numeric_limits<long long>::min()};
  const volatile Record* e = &r;
  const std::string name = "dispatch";
  const char* stage = "put";
  std::puts(strCat("ep ", name, ": rank ", e->rank, " code ", e->code, " a ", e->value_a).c_str());
  std::puts(strCat("after ", 4.0, " s, ", 0.5, " s, ", 1e-7, ", ", 123456789.0).c_str());
  std::puts(strCat("bytes ", size_t{18446744073709551615ull}, " u32 ", uint32_t{4000000000u},
                   " char ", 'x', " stage ", stage).c_str());
  std::puts(strCat("word ", Hex{0}, " ", Hex{0xdeadbeefcafeull}, " ", Hex{~0ull}).c_str());
  std::puts(strCat().empty() ? "empty" : "not empty");
  return 0;
}
"""

EXPECTED = [
    "ep dispatch: rank -1 code 3 a -9223372036854775808",
    "after 4 s, 0.5 s, 1e-07, 1.23457e+08",
    "bytes 18446744073709551615 u32 4000000000 char x stage put",
    "word 0x0 0xdeadbeefcafe 0xffffffffffffffff",
    "empty",
]


def test_str_cat_formats_like_an_ostream(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    source = tmp_path / "str_cat_check.cpp"
    source.write_text(PROGRAM)
    binary = tmp_path / "str_cat_check"
    subprocess.run(
        [cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(NATIVE), str(source), "-o", str(binary)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    assert out.splitlines() == EXPECTED
