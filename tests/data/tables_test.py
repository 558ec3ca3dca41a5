"""Rows and text from tables (`mptrain.data.tables`: `.parquet`, `.arrow`, `.csv`, written here
by pyarrow) read as the jsonl they were written from: the same SFT, DPO and RL rows, the same
cached tokens; a missing column or an unreadable file is one line; a long build says how far
it is. No compiles."""

import importlib
import logging
from pathlib import Path

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from sft_test import CHATS, PAIRS, _config, _write

from mptrain import errors
from mptrain.data import examples, sft, tables, token_cache, tokenize

DPO = [{"prompt": f"Say {k}.", "chosen": f"{k}", "rejected": f"{k + 1}"} for k in range(12)]
PROMPTS = [
    {"prompt": [{"role": "user", "content": f"{k} + {k} ="}], "answer": f"#### {2 * k}"}
    for k in range(12)
]


@pytest.fixture(autouse=True)
def _fresh():
    token_cache._OPENED.clear()
    yield
    token_cache._OPENED.clear()


def _tables(folder, rows, name, csv=False) -> list[str]:
    """`rows` as a Parquet file (row groups of 7), an Arrow IPC stream (batches of 5, as
    `datasets.save_to_disk` writes) and, where every value is text, a CSV file."""
    table = pa.Table.from_pylist(rows)
    made = [folder / f"{name}.parquet", folder / f"{name}.arrow"]
    pq.write_table(table, made[0], row_group_size=7)
    with pa.OSFile(str(made[1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table, max_chunksize=5)
    if csv:
        made.append(folder / f"{name}.csv")
        pyarrow.csv.write_csv(table, made[-1])
    return [str(p) for p in made]


@pytest.mark.parametrize(
    "rows, csv",
    [(PAIRS, True), (CHATS, False), (DPO, True), (PROMPTS, False)],
    ids=["sft pairs", "sft chats", "dpo", "rl prompts"],
)
def test_a_tables_rows_are_those_of_the_jsonl_it_was_written_from(tmp_path, rows, csv):
    want = [row for _, row in examples.in_files((_write(tmp_path / "rows.jsonl", rows),))]
    assert want == rows
    for table in _tables(tmp_path, rows, "rows", csv):
        found = list(examples.in_files((table,)))
        assert [row for _, row in found] == want, table
        assert found[3][0] == f"{table} row 3"


def test_sft_from_parquet_caches_the_tokens_of_its_jsonl(tmp_path):
    """The same packed rows (the token cache's contents) from the jsonl and from the table;
    the cache's name covers the file it was read from."""
    found = {}
    for name, files in [
        (
            "jsonl",
            [_write(tmp_path / "pairs.jsonl", PAIRS), _write(tmp_path / "chats.jsonl", CHATS)],
        ),
        ("parquet", [_tables(tmp_path, PAIRS, "pairs")[0], _tables(tmp_path, CHATS, "chats")[0]]),
    ]:
        config = _config(tmp_path, files=files, eval_fraction=0.1, seq_len=256)
        train, held_out = sft.create_sources(config)
        found[name] = (train.rows, held_out.rows)
    for a, b in zip(found["jsonl"], found["parquet"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(list((tmp_path / "cache").rglob("*.npy"))) == 2


def test_a_text_corpus_from_a_table_is_its_text_column_a_document_a_row(tmp_path, caplog):
    """A table's `text` column tokenizes as the jsonl's `text` fields do; a build that takes
    long logs how far it is (here every document: `PROGRESS_EVERY_S` 0)."""
    docs = [{"text": f"Document {k}: " + "words " * k, "id": k} for k in range(30)]
    jsonl = _write(tmp_path / "docs.jsonl", docs)
    parquet = _tables(tmp_path, docs, "docs")[0]
    corpora = [tokenize.create_corpus((f,), "bytes", None, str(tmp_path)) for f in (jsonl, parquet)]
    want, got = ([bytes(ids) for ids in tokenize.encoded(c)] for c in corpora)
    assert got == want and len(got) == 30
    caplog.set_level(logging.INFO)
    token_cache.PROGRESS_EVERY_S, every = 0.0, token_cache.PROGRESS_EVERY_S
    try:
        token_cache.tokens(corpora[1])
    finally:
        token_cache.PROGRESS_EVERY_S = every
    assert "data: tokenizing: file 1 of 1, 30 documents, 0.0 MB of text, " in caplog.text


def test_a_table_without_the_column_or_unreadable_is_one_line_naming_it(tmp_path):
    path = _tables(tmp_path, [{"body": "x"}] * 3, "docs")[0]
    with pytest.raises(errors.ConfigError, match=r"docs.parquet: no column 'text' \(it has body\)"):
        list(tables.texts(path))
    config = _config(tmp_path, files=[path])
    with pytest.raises(errors.ConfigError, match=r"docs.parquet row 0: "):
        sft.create_sources(config)
    (tmp_path / "cut.parquet").write_bytes(Path(path).read_bytes()[:100])
    with pytest.raises(errors.ConfigError, match=r"config.data.files: cannot read .*cut.parquet"):
        list(examples.in_files((str(tmp_path / "cut.parquet"),)))


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_dpo_pairs_and_rl_prompts_from_parquet_give_the_batches_of_their_jsonl(tmp_path, name):
    """The train and held-out batches a step is given (so its loss too) are the same arrays
    from the table as from the jsonl it was written from."""
    module = importlib.import_module(f"mptrain.data.{name}")
    rows = DPO if name == "dpo" else PROMPTS
    found = []
    for files in ([_write(tmp_path / "rows.jsonl", rows)], [_tables(tmp_path, rows, "rows")[0]]):
        config = _config(tmp_path, name=name, files=files)
        if name == "grpo":
            config.grpo = ml_collections.ConfigDict({"num_generations": 4})
            config.grpo.max_completion_length = 16
        token_cache._OPENED.clear()
        train, held_out = module.create_sources(config)
        found.append([s.get_batch(i) for s in (train, held_out) if s for i in range(3)])
    assert len(found[0]) == len(found[1]) > 0
    for a, b in zip(*found, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
