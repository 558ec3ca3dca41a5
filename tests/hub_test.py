"""A model named by its Hub id (`mptrain.hub`): what is an id and what a path; an id neither
cached nor reachable is one line. (Training from a Hub cache: tests/train/init_from_test.py;
a plan from a cache holding config.json alone: tests/plan/plan_test.py.)"""

from pathlib import Path

import jax
import pytest
from helpers import FIXTURE, ROOT, hub_cache, make_tokenizer, offline_hub, run_cli

from mptrain import errors, generate, hub


def test_an_id_is_org_slash_name_at_revision_and_never_a_path_that_is_there(tmp_path, monkeypatch):
    assert hub.parse("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert hub.parse("meta-llama/Llama-3.2-1B@v1.0") == ("meta-llama/Llama-3.2-1B", "v1.0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "ft").mkdir(parents=True)
    for path in ("runs/ft", "/models/Qwen3", "./org/name", "bytes", "tok/tokenizer.json", "a/b/c"):
        assert hub.parse(path) is None, path
    assert hub.folder("runs/ft", hub.CONFIG, "x") == "runs/ft"  # a local folder wins


@pytest.mark.parametrize("online", [False, True], ids=["offline", "unreachable"])
def test_a_hub_id_neither_cached_nor_reachable_is_one_line_exit_2(
    online, tmp_path, monkeypatch, capsys
):
    """Not in the cache, and offline (HF_HUB_OFFLINE=1) or the Hub unreachable (here a closed
    port on this machine): one line naming the id, the cache and why; nothing written."""
    from huggingface_hub import constants

    offline_hub(monkeypatch, tmp_path / "hub")
    if online:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    config = f"--config={ROOT / 'configs' / 'hf.py'}:mptrain-tests/tyni"
    code, err = run_cli(tmp_path / "run", capsys=capsys, config=config)
    assert code == 2 and not (tmp_path / "run").exists()
    (line,) = err.strip().splitlines()
    assert "'mptrain-tests/tyni': no such folder here, and as a Hub id: not in its cache " in line
    assert str(tmp_path / "hub") in line
    why = "could not be reached (ConnectError" if online else "HF_HUB_OFFLINE=1 forbids"
    assert why in line, line
    with pytest.raises(errors.ConfigError, match=r"^--hf='mptrain-tests/tyni': no such folder"):
        generate.load(None, "mptrain-tests/tyni", None, None)


def test_a_hub_datasets_files_are_read_from_the_cache_as_local_ones(tmp_path, monkeypatch):
    """`data.files="hf://datasets/ORG/NAME/GLOB"`: the files GLOB matches in the dataset's
    snapshot (offline here), read as the same files on disk are; the dataset alone names its
    train split (data.files) or test split (data.eval_files), laid out as `datasets` finds
    them; a dataset not in the cache is one line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mptrain.data import examples, tokenize

    rows = [{"prompt": f"Q{k}?", "completion": f"A{k}."} for k in range(5)]
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "repo" / "data" / "train-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "repo" / "data" / "test-0.parquet")
    (tmp_path / "repo" / "README.md").write_text("a card")
    offline_hub(monkeypatch, tmp_path / "hub")
    hub_cache(tmp_path / "hub", "mptrain-tests/qa", tmp_path / "repo", kind="dataset")
    url = "hf://datasets/mptrain-tests/qa/data/train-*.parquet"
    (path,) = tokenize.find_files("data.files", url, examples.SUFFIXES)
    assert "/datasets--mptrain-tests--qa/snapshots/" in path
    assert path.endswith("/data/train-0.parquet")
    assert [row for _, row in examples.in_files((path,))] == rows
    # the dataset alone: its train split for data.files, its test split for data.eval_files
    dataset = "hf://datasets/mptrain-tests/qa"
    assert tokenize.find_files("data.files", dataset, examples.SUFFIXES) == (path,)
    (test,) = tokenize.find_files("data.eval_files", dataset, examples.SUFFIXES)
    assert test.endswith("/data/test-0.parquet")
    with pytest.raises(errors.ConfigError, match=r"data.files='hf://datasets/mptrain-tests/qb/"):
        tokenize.find_files("data.files", "hf://datasets/mptrain-tests/qb/*.parquet", (".x",))


def test_generate_reads_a_model_by_its_hub_id_from_the_cache(tmp_path, monkeypatch):
    """`python -m mptrain.generate --hf=ORG/NAME`: the weights, config and tokenizer from the
    snapshot, the same params as the folder by path (nothing compiled here)."""
    import shutil

    import numpy as np

    folder = Path(shutil.copytree(FIXTURE, tmp_path / "llama"))
    make_tokenizer(folder, ["some text to learn a few merges from"] * 4)
    offline_hub(monkeypatch, tmp_path / "hub")
    hub_cache(tmp_path / "hub", "mptrain-tests/tiny", folder)
    by_id = generate.load(None, "mptrain-tests/tiny", None, "fp32")
    by_path = generate.load(None, str(folder), None, "fp32")
    assert "/models--mptrain-tests--tiny/snapshots/" in by_id.where
    for a, b in zip(jax.tree.leaves(by_id.params), jax.tree.leaves(by_path.params), strict=True):
        np.testing.assert_array_equal(a, b)
