"""Where SFT, DPO and RL rows come from (`data.sft`, `data.dpo`, `data.grpo`): the lines of
`.jsonl` files, the items of `.json` files, the rows of tables as the Hub serves datasets
(`.parquet`, `.arrow`, `.csv`: `mptrain.data.tables`), or the embedded set made from the
Python standard library. Each comes with where it was found (file and line or row), for the
one-line error that names a bad one.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
from typing import Any

from mptrain import errors
from mptrain.data import tables, text

SUFFIXES = (".jsonl", ".json", *tables.SUFFIXES)  # the files `data.files` may name for rows
EMBEDDED_MAX_CHARS = 480  # of an embedded pair: one fits a row of 512 with room to spare


def embedded() -> Iterator[tuple[str, dict]]:
    """The embedded set: for each public function or method of the Python standard library
    (`text.list_files`' files) with a docstring, the prompt is its dotted name and signature
    and a newline, the completion the docstring's first paragraph (at least 20 characters, the
    pair at most `EMBEDDED_MAX_CHARS`). About 4,700 pairs on CPython 3.11, the same on every
    machine with the same Python build. Yields `(where, example)`."""
    root = text.stdlib_root()
    for rel in text.list_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            source = f.read()
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # a file of another Python's grammar: not text here
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        for name, node in _functions(tree.body, module + "."):
            doc = ast.get_docstring(node)
            first = doc.split("\n\n")[0].strip() if doc else ""
            prompt = f"{name}({ast.unparse(node.args)})\n"
            if len(first) >= 20 and len(prompt) + len(first) <= EMBEDDED_MAX_CHARS:
                where = f"the standard library's {rel} line {node.lineno}"
                yield where, {"prompt": prompt, "completion": first}


def key(files: Any) -> str:
    """What a refusal of one example names as its source: `config.data.files`, or the embedded
    set where none is set."""
    return "config.data.files" if files else "config.data.files unset, the embedded set"


def _functions(body: list, prefix: str) -> Iterator[tuple[str, Any]]:
    for node in body:
        if node.__class__.__name__ in ("FunctionDef", "AsyncFunctionDef"):
            if not node.name.startswith("_"):
                yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _functions(node.body, f"{prefix}{node.name}.")


def read_examples(path: str, key: str = "config.data.files") -> Iterator[tuple[str, Any]]:
    """`(where, example)` of a file's examples: each line of a `.jsonl` (blank lines skipped),
    each item of a `.json` list. A file that does not read, a line that is not JSON, or a file
    with no example is a `ConfigError` naming `key`, the file (and line). A table's rows: its
    record batches in turn (`rows`)."""
    if path.endswith(tables.SUFFIXES):
        yield from tables.rows(path, key)
        return
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as e:
        raise errors.ConfigError(f"{key}: cannot read {path} ({e.strerror})") from None
    count = 0
    if path.endswith(".json"):
        items = _parsed(content, path, key)
        if not isinstance(items, list):
            raise errors.ConfigError(f"{key}: {path} is not a list of examples")
        for k, item in enumerate(items):
            count += 1
            yield f"{path} item {k}", item
    else:
        for number, line in enumerate(content.splitlines(), 1):
            if line.strip():
                count += 1
                yield f"{path} line {number}", _parsed(line, f"{path} line {number}", key)
    if not count:
        raise errors.ConfigError(f"{key}: {path} holds no example")


def _parsed(text: bytes, where: str, key: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise errors.ConfigError(f"{key}: {where}: not JSON ({errors.first_line(e)})") from None


def in_files(paths: tuple[str, ...], key: str = "config.data.files") -> Iterator[tuple[str, Any]]:
    for path in paths:
        yield from read_examples(path, key)
