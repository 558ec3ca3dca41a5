"""Tables as the Hub serves datasets: `.parquet`, `.arrow` and `.csv` files, read with pyarrow
(the extra `mptrain[data]`: one package, where `datasets` brings pandas and five more) a
record batch at a time, so that a file larger than memory is read in bounded memory (a
buffered stream of the file, not pyarrow's read-ahead of whole row groups).

`rows` gives the rows of SFT, DPO and RL files (`mptrain.data.examples`) as the dicts `datasets`
would give (a list of structs, a conversation, a list of dicts): a row reads the same from a
table as from the jsonl it was written from. `texts` gives a text corpus's documents, a column's
strings (`mptrain.data.tokenize`). An `.arrow` file is Arrow's IPC file or stream format (the
stream is what `datasets.save_to_disk` writes). A CSV file's cells are all read as text
(`"0"` stays `"0"`, where type inference would make a DPO answer a number).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mptrain import errors

SUFFIXES = (".parquet", ".arrow", ".csv")
BATCH_ROWS = 1024  # rows decoded at a time


def _pyarrow(key: str, path: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise errors.ConfigError(
            f"{key}: {path}: reading a table needs pyarrow: pip install 'mptrain[data]'"
        ) from None
    return pyarrow


def batches(path: str, key: str = "config.data.files") -> Iterator[Any]:
    """The record batches of the table `path`; one pyarrow cannot read is a `ConfigError`
    naming `key` and the file."""
    pa = _pyarrow(key, path)
    try:
        yield from _batches(pa, path)
    except (OSError, pa.ArrowException) as e:
        raise errors.ConfigError(f"{key}: cannot read {path} ({errors.first_line(e)})") from None


def _batches(pa: Any, path: str) -> Iterator[Any]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        # pyarrow's defaults pre-buffer and read ahead on threads: reading a 2 GB file held
        # 1.9 GB in its pool; a buffered stream read in turn holds about 80 MB, and ran faster
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        yield from parquet.iter_batches(batch_size=BATCH_ROWS, use_threads=False)
    elif path.endswith(".csv"):  # every column text: a CSV cell holds no type of its own
        import csv

        import pyarrow.csv

        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
        text = pyarrow.csv.ConvertOptions(column_types=dict.fromkeys(header, pa.string()))
        yield from pyarrow.csv.open_csv(path, convert_options=text)
    else:
        with pa.memory_map(path) as source:
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid:  # not the file format: the stream format
                source.seek(0)
                yield from pa.ipc.open_stream(source)
                return
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)


def rows(path: str, key: str = "config.data.files") -> Iterator[tuple[str, dict]]:
    """`(where, row)` of the table `path`, in order; a file with no row is a `ConfigError`."""
    count = 0
    for batch in batches(path, key):
        for row in batch.to_pylist():
            yield f"{path} row {count}", row
            count += 1
    if not count:
        raise errors.ConfigError(f"{key}: {path} holds no example")


def texts(path: str, column: str = "text", key: str = "config.data.files") -> Iterator[str]:
    """The strings of the table's `column`, row by row; a table without it, or a row whose
    value is not a string, is a `ConfigError` naming the file (and the row)."""
    count = 0
    for batch in batches(path, key):
        if column not in batch.schema.names:
            names = ", ".join(batch.schema.names)
            raise errors.ConfigError(f"{key}: {path}: no column {column!r} (it has {names})")
        for value in batch.column(column).to_pylist():
            if not isinstance(value, str):
                raise errors.ConfigError(f"{key}: {path} row {count}: {column!r} is not text")
            yield value
            count += 1
