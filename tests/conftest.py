"""Shared test helpers. Tests run on CPU with fake devices (see the Makefile's XLA_FLAGS)."""

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_config(name: str, arg: str | None = "tiny", **overrides):
    """`configs/<name>.py:get_config(arg)` with dotted-key overrides, like --config.a.b=v."""
    config = runpy.run_path(str(ROOT / "configs" / f"{name}.py"))["get_config"](arg)
    for key, value in overrides.items():
        section = config
        *parents, leaf = key.split(".")
        for parent in parents:
            section = section[parent]
        section[leaf] = value
    return config


_DOT = re.compile(r"stablehlo\.(dot_general|convolution)\b.*:\s*\((tensor<[^)]*)\)\s*->\s*(\S+)")
_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([a-z]+[0-9]*)>")


def matmul_dtypes(lowered_text: str) -> list[tuple[tuple[str, ...], str]]:
    """(operand dtypes, result dtype) of every dot_general/convolution in a lowered program."""
    found = []
    for line in lowered_text.splitlines():
        match = _DOT.search(line)
        if match:
            operands = tuple(_TYPE.findall(match.group(2)))
            (result,) = _TYPE.findall(match.group(3))
            found.append((operands, result))
    return found
