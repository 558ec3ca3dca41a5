"""Shared test helpers. Tests run on CPU with fake devices (see the Makefile's XLA_FLAGS)."""

import re

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
