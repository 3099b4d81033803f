"""docs/configuration.md lists every Options field and every EP_* variable the code reads: no more,
no fewer. The code's reads are found in the sources (Python, C++/CUDA, CMake, shell tools)."""

from __future__ import annotations

import re
from pathlib import Path

import ep_backend

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"

# How each kind of source reads an environment variable.
_PY_READ = re.compile(
    r"""(?:os\.environ(?:\.get|\.setdefault|\.pop)?\s*\(\s*|os\.environ\s*\[\s*|os\.getenv\s*\(\s*)"""
    r"""["'](EP_[A-Z0-9_]+)["']"""
)
# C++: every "EP_..." string literal (native code names variables only as getenv arguments, entries
# of the env registry and messages that name one), comments stripped first.
_CPP_LITERAL = re.compile(r'"(EP_[A-Z0-9_]+)')
_CMAKE_READ = re.compile(r"\$ENV\{(EP_[A-Z0-9_]+)\}")
_SH_READ = re.compile(r"\$\{?(EP_[A-Z0-9_]+)")


def _strip_cpp_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _sources(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        files += [p for p in ROOT.glob(pattern) if p.is_file()]
    return files


def variables_read() -> dict[str, set[str]]:
    """EP_* variable -> the files that read it."""
    found: dict[str, set[str]] = {}

    def add(name: str, path: Path) -> None:
        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))

    for path in _sources(["setup.py", "ep_backend/**/*.py", "tests/*.py", "tools/*.py"]):
        if path.name == Path(__file__).name:  # this file's own examples
            continue
        for name in _PY_READ.findall(path.read_text(encoding="utf-8")):
            add(name, path)
    for path in _sources(["native/**/*.cpp", "native/**/*.hpp", "native/**/*.cu",
                          "native/**/*.cuh", "native/**/*.h", "python_api/*.cpp"]):  # fmt: skip
        for name in _CPP_LITERAL.findall(_strip_cpp_comments(path.read_text(encoding="utf-8"))):
            add(name, path)
    for path in _sources(["CMakeLists.txt", "native/**/*.cmake"]):
        for name in _CMAKE_READ.findall(path.read_text(encoding="utf-8")):
            add(name, path)
    for path in _sources(["tools/*.sh"]):
        for name in _SH_READ.findall(path.read_text(encoding="utf-8")):
            add(name, path)
    return found


def _section(heading: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/configuration.md has no '## {heading}' section"
    return match.group(1)


def _table_names(section: str, prefix: str = "") -> set[str]:
    """The first-column names (in backticks) of a section's table rows."""
    return set(re.findall(rf"^\|\s*`({prefix}[A-Za-z0-9_]+)`", section, re.M))


def test_every_variable_the_code_reads_is_on_the_page_and_no_other() -> None:
    read = variables_read()
    listed = _table_names(_section("Environment variables"), "EP_")
    missing = {name: sorted(files) for name, files in read.items() if name not in listed}
    stale = sorted(listed - set(read))
    assert not missing, f"read by the code but not in docs/configuration.md: {missing}"
    assert not stale, f"listed in docs/configuration.md but read nowhere: {stale}"


def test_every_options_field_is_on_the_page_and_no_other() -> None:
    # ep's own fields: those its binding defines (torch's Backend.Options adds fields that
    # change from one torch version to the next, e.g. enable_reconfigure in 2.14).
    fields = {n for n, v in vars(ep_backend.Options).items() if isinstance(v, property)}
    assert {"num_sms", "timeout"} <= fields, fields  # the lookup itself works
    listed = _table_names(_section("Options"))
    assert fields - listed == set(), f"Options fields not on the page: {sorted(fields - listed)}"
    assert listed - fields == set(), (
        f"on the page but not Options fields: {sorted(listed - fields)}"
    )


def test_the_scanner_finds_reads_in_each_language(tmp_path: Path) -> None:
    """The patterns above must see each way the code reads a variable (else the check is empty)."""
    assert _PY_READ.findall('x = os.environ.get("EP_A", "1"); os.environ["EP_B"]') == [
        "EP_A",
        "EP_B",
    ]
    assert _PY_READ.findall("os.getenv('EP_C')") == ["EP_C"]
    cpp = 'std::getenv("EP_D"); // "EP_NOT_A_READ"\n/* "EP_NOR_THIS" */ kEnv{"EP_E"}'
    assert _CPP_LITERAL.findall(_strip_cpp_comments(cpp)) == ["EP_D", "EP_E"]
    assert _SH_READ.findall("x=${EP_F:-1} y=$EP_G") == ["EP_F", "EP_G"]
    read = variables_read()
    assert "EP_WITH_CUDA" in read and "setup.py" in read["EP_WITH_CUDA"]
    assert any(f.startswith("native/") for files in read.values() for f in files)
