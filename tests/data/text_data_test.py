"""The offline text corpus and its deterministic batch sources."""

import os

import numpy as np
import pytest

from mptrain.data import text


def _write(root, rel, content):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


@pytest.fixture
def fake_stdlib(tmp_path):
    root = str(tmp_path / "lib")
    # Created out of order on purpose: the corpus order must come from sorting, not the disk.
    _write(root, "zz.py", b"ZZ")
    _write(root, "a/b.py", b"AB")
    _write(root, "a.py", b"A")
    _write(root, "a_b.py", b"A_B")
    _write(root, "notes.txt", b"TXT")
    for excluded in ("site-packages", "dist-packages", "__pycache__", "test", "a/tests"):
        _write(root, f"{excluded}/x.py", b"EXCLUDED")
    _write(root, "idlelib/idle_test/y.py", b"EXCLUDED")
    _write(root, "idlelib/kept.py", b"IDLE")
    return root


def test_corpus_is_sorted_by_posix_path_and_skips_excluded_dirs(fake_stdlib):
    assert text.list_files(fake_stdlib) == ["a.py", "a/b.py", "a_b.py", "idlelib/kept.py", "zz.py"]
    corpus = text.load_corpus(root=fake_stdlib)
    assert corpus.dtype == np.uint8
    assert corpus.tobytes() == b"A\nAB\nA_B\nIDLE\nZZ"
    assert text.load_corpus(3, root=fake_stdlib).tobytes() == b"A\nA"


def test_stdlib_corpus_is_stable_and_has_no_installed_packages():
    files = text.list_files(text.stdlib_root())
    assert files == sorted(files)
    assert len(files) > 100
    for rel in files:
        parts = rel.split("/")
        assert not text.EXCLUDED_DIRS.intersection(parts[:-1]), rel
        assert rel.endswith(".py")
    first = text.load_corpus()
    text._CORPUS_CACHE.clear()  # force a second read from disk
    second = text.load_corpus()
    assert first is not second
    np.testing.assert_array_equal(first, second)
    assert 1_000_000 < len(first) < 100_000_000
    assert not first.flags.writeable  # the cached corpus cannot be modified by a caller


def test_load_corpus_rejects_bad_max_bytes():
    with pytest.raises(ValueError, match="max_bytes.*-5"):
        text.load_corpus(-5)


def test_eval_split_is_the_last_one_percent():
    data = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    train, evaluation = text.split_corpus(data)
    assert len(evaluation) == 100
    np.testing.assert_array_equal(evaluation, data[-100:])
    np.testing.assert_array_equal(train, data[:-100])
    train, evaluation = text.split_corpus(data, eval_fraction=0.25)
    assert len(evaluation) == 2500
    with pytest.raises(ValueError, match="eval_fraction.*1.5"):
        text.split_corpus(data, eval_fraction=1.5)


def _corpus(n=5_000):
    return np.random.default_rng(0).integers(0, 256, size=n).astype(np.uint8)


def test_train_batches_are_a_pure_function_of_seed_and_index():
    data = _corpus()
    source = text.TextSource(data, seq_len=16, batch_size=4, seed=3)
    batch = source.get_batch(7)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 16)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    # Same (seed, index) from a fresh source, after other batches were drawn: identical.
    other = text.TextSource(data, seq_len=16, batch_size=4, seed=3)
    other.get_batch(0)
    again = other.get_batch(7)
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(batch[key], again[key])
    # A different index or a different seed: different windows.
    assert not np.array_equal(batch["inputs"], source.get_batch(8)["inputs"])
    reseeded = text.TextSource(data, seq_len=16, batch_size=4, seed=4).get_batch(7)
    assert not np.array_equal(batch["inputs"], reseeded["inputs"])


def test_targets_are_inputs_shifted_by_one_byte():
    data = _corpus()
    source = text.TextSource(data, seq_len=16, batch_size=8, seed=0)
    batch = source.get_batch(0)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for row, offset in zip(batch["inputs"], source.offsets(0), strict=True):
        np.testing.assert_array_equal(row, data[offset : offset + 16])
    for offset in source.offsets(0):
        assert 0 <= offset <= len(data) - 17
    # Every window can reach the last byte of the data as a target.
    tiny = text.TextSource(np.arange(5, dtype=np.uint8), seq_len=4, batch_size=3, seed=0)
    np.testing.assert_array_equal(tiny.get_batch(0)["targets"], [[1, 2, 3, 4]] * 3)


def test_eval_batches_cover_the_split_in_order_then_wrap():
    data = _corpus(1_000)
    source = text.TextSource(data, seq_len=10, batch_size=16, random=False)
    assert source.num_windows == 99  # (1000 - 1) // 10
    assert source.num_batches == 7
    batches = [source.get_batch(i) for i in range(source.num_batches)]
    inputs = np.concatenate([b["inputs"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])
    covered = source.num_windows * 10
    np.testing.assert_array_equal(inputs.reshape(-1)[:covered], data[:covered])
    np.testing.assert_array_equal(targets.reshape(-1)[:covered], data[1 : covered + 1])
    # The last batch (windows 96..111) is filled by wrapping around to windows 0..12.
    np.testing.assert_array_equal(batches[-1]["inputs"][3], data[:10])
    np.testing.assert_array_equal(batches[-1]["inputs"][-1], data[120:130])
    # Eval batches do not depend on the seed.
    reseeded = text.TextSource(data, seq_len=10, batch_size=16, seed=9, random=False)
    np.testing.assert_array_equal(reseeded.get_batch(2)["inputs"], batches[2]["inputs"])


def test_text_source_validates_its_arguments():
    data = _corpus(100)
    with pytest.raises(ValueError, match="100 bytes.*seq_len \\+ 1 = 101"):
        text.TextSource(data, seq_len=100, batch_size=1)
    with pytest.raises(ValueError, match="batch_size.*0"):
        text.TextSource(data, seq_len=8, batch_size=0)
    with pytest.raises(ValueError, match="seed.*-1"):
        text.TextSource(data, seq_len=8, batch_size=1, seed=-1)
    with pytest.raises(ValueError, match="uint8"):
        text.TextSource(data.astype(np.int32), seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="index.*-2"):
        text.TextSource(data, seq_len=8, batch_size=1).get_batch(-2)


def test_build_text_sources_from_a_config():
    ml_collections = pytest.importorskip("ml_collections")
    config = ml_collections.ConfigDict({"seq_len": 32, "max_bytes": 200_000})
    train, evaluation = text.build_text_sources(config, batch_size=4, seed=1)
    assert len(train.data) + len(evaluation.data) == 200_000
    assert len(evaluation.data) == 2_000
    assert train.random and not evaluation.random
    assert train.get_batch(0)["inputs"].shape == (4, 32)


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.5])
@pytest.mark.parametrize("seq_len", [32, 128])
def test_too_small_max_bytes_names_the_least_that_works(seq_len, fraction):
    def suggested(max_bytes):
        with pytest.raises(ValueError, match="max_bytes must be at least") as caught:
            text.check_sizes(max_bytes, seq_len, fraction, max_bytes)
        return int(str(caught.value).rsplit(" ", 1)[-1])

    least = suggested(seq_len)  # too small for any split
    text.check_sizes(least, seq_len, fraction, least)  # enough: no error
    assert suggested(least - 1) == least  # one byte fewer is not
