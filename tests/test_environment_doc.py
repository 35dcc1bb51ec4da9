"""docs/ENVIRONMENT.md lists exactly the FP4COMPILE_* environment variables the package reads, and each row's
attribute exists with the row's default value."""
import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ENVIRONMENT.md"
NAME = re.compile(r"FP4COMPILE_[A-Z0-9_]*[A-Z0-9]")


def _package_names():
    names = set()
    for path in (ROOT / "fp4compile").rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def _rows():
    """{variable: (attribute cell, values cell)} of the doc's tables."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = NAME.fullmatch(cells[0].strip("`")) if len(cells) >= 4 else None
        if m:
            assert m.group(0) not in rows, f"{m.group(0)} is listed twice"
            rows[m.group(0)] = (cells[1], cells[2])
    return rows


def test_every_variable_the_package_reads_is_documented_and_no_other():
    documented, read = set(_rows()), _package_names()
    assert read - documented == set(), "read by fp4compile but not in docs/ENVIRONMENT.md"
    assert documented - read == set(), "in docs/ENVIRONMENT.md but no longer read by fp4compile"


def _default(values: str) -> str:
    first = values.split(",")[0].strip()
    return first.split("`")[1] if "`" in first else first


@pytest.mark.parametrize("var", sorted(v for v, (attr, _) in _rows().items() if attr.startswith("`")))
def test_documented_attribute_exists_with_the_documented_default(var, monkeypatch):
    """The attribute a row names exists; where the row's default is a literal (`...`) and the variable is unset in
    this process, the attribute holds it (compared as text: "1" for True, "0" for False)."""
    attr, values = _rows()[var]
    for dotted in re.findall(r"`([a-z_.]+\.[A-Z_]+)`", attr):
        mod, _, name = dotted.rpartition(".")
        module = importlib.import_module(f"fp4compile.{mod}")
        assert hasattr(module, name), f"{var}: fp4compile.{dotted} does not exist"
        default = _default(values)
        if var in os.environ or "`" not in values.split(",")[0] or name == "AUTOTUNE_STORE":
            continue
        value = getattr(module, name)
        if var in ("FP4COMPILE_SR_RP", "FP4COMPILE_FAST_LAUNCH") and os.environ.get("TRITON_INTERPRET") == "1":
            continue                                   # off under the interpreter, whatever the variable says
        text = {True: "1", False: "0"}.get(value, str(value)) if isinstance(value, (bool, int, str, Path)) else None
        assert text == default, f"{var}: fp4compile.{dotted} is {value!r}, the doc says the default is {default!r}"
