"""Tokenized text (`data.files`, `data.tokenizer`, the token cache) and pre-tokenized files
(`data.name="tokens"`), on a BPE tokenizer trained here and a few files in tmp_path."""

import errno
import json
import logging
import mmap
import os
import subprocess
import sys
import time

import ml_collections
import numpy as np
import pytest
from helpers import EOT, ROOT, load_config, make_tokenizer

from mptrain import config as config_lib
from mptrain import errors
from mptrain.data import text, token_cache, tokenize, tokens

EOS = EOT
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "mixed", "precision")


def _prose(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, 12)) for _ in range(words // 12)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer of 300 words with GPT-2's end-of-text token, trained here."""
    folder = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(folder, [_prose(0, 2000)], vocab_size=300)
    return folder


@pytest.fixture
def corpus_dir(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(_prose(1, 600))
    (folder / "sub" / "a.md").write_text("# notes\n" + _prose(2, 300))
    docs = [{"text": f"jsonl document {i} mentions {EOS} as text"} for i in range(3)]
    (folder / "c.jsonl").write_text("".join(json.dumps(d) + "\n\n" for d in docs))
    return folder


@pytest.fixture(autouse=True)
def fresh_process_state():
    """Each test sees the cache as a new process would (nothing opened yet)."""
    token_cache._OPENED.clear()
    yield
    token_cache._OPENED.clear()


def _data(corpus_dir, tokenizer_dir, **keys):
    base = {
        "seq_len": 16,
        "files": str(corpus_dir / "**" / "*.*"),
        "tokenizer": str(tokenizer_dir),
        "cache_dir": str(corpus_dir.parent / "cache"),
        "eval_fraction": 0.1,
    }
    return ml_collections.ConfigDict(base | keys)


def _build(data_config, batch_size=4, seed=0):
    return text.build_text_sources(data_config, batch_size=batch_size, seed=seed)


def _mapped(array) -> bool:
    """Whether `array` reads a memory-mapped file."""
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, mmap.mmap)


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ---- the stream ------------------------------------------------------------------------------


def test_documents_are_encoded_alone_and_joined_by_the_end_of_text_token(corpus_dir, tokenizer_dir):
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bpe.encode_special_tokens = True
    eos = bpe.token_to_id(EOS)
    files = [corpus_dir / "b.txt", corpus_dir / "c.jsonl", corpus_dir / "sub" / "a.md"]  # sorted
    docs = [files[0].read_text()]
    docs += [json.loads(line)["text"] for line in files[1].read_text().splitlines() if line]
    docs += [files[2].read_text()]
    expected = []
    for doc in docs:
        expected += ([eos] if expected else []) + bpe.encode(doc).ids
    train, evaluation = _build(_data(corpus_dir, tokenizer_dir))
    stream = np.concatenate([train.data, evaluation.data])
    assert train.data.dtype == np.uint16
    np.testing.assert_array_equal(stream, expected)
    assert (stream == eos).sum() == len(docs) - 1  # the EOS spelt inside the jsonl text is text
    assert len(evaluation.data) == round(len(stream) * 0.1)


def test_batches_are_a_pure_function_of_seed_and_index(corpus_dir, tokenizer_dir):
    config = _data(corpus_dir, tokenizer_dir)
    train, _ = _build(config, seed=3)
    batch = train.get_batch(7)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    token_cache._OPENED.clear()  # a resumed run: a new process, the cache file reused
    again, _ = _build(config, seed=3)
    again.get_batch(0)
    np.testing.assert_array_equal(again.get_batch(7)["inputs"], batch["inputs"])
    for offset, row in zip(train.offsets(7), batch["inputs"], strict=True):
        np.testing.assert_array_equal(row, train.data[offset : offset + 16])
    assert not np.array_equal(_build(config, seed=4)[0].get_batch(7)["inputs"], batch["inputs"])


def test_the_default_bytes_are_todays_stdlib_windows_bit_for_bit():
    """No data.files and the byte tokenizer: the corpus and the windows of the rule this source
    had before tokenizers, written out here, and no cache file."""
    config = ml_collections.ConfigDict({"seq_len": 32, "max_bytes": 300_000})
    train, evaluation = _build(config, seed=5)
    root = text.stdlib_root()
    chunks = []
    for rel in text.list_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            chunks.append(f.read())
    corpus = np.frombuffer(b"\n".join(chunks), np.uint8)[:300_000]
    np.testing.assert_array_equal(train.data, corpus[:297_000])
    np.testing.assert_array_equal(evaluation.data, corpus[297_000:])
    for i in (0, 9):
        starts = np.random.default_rng([5, i]).integers(0, 297_000 - 32, size=4)
        windows = corpus[starts[:, None] + np.arange(33)].astype(np.int32)
        np.testing.assert_array_equal(train.get_batch(i)["inputs"], windows[:, :-1])
    assert not token_cache._OPENED


def test_bytes_of_the_users_files_are_the_embedded_corpus_rule(tmp_path):
    """The byte tokenizer over files: each byte a token, files joined by a newline, in sorted
    order: the stdlib corpus's rule, applied to a folder, through the cache (uint8)."""
    root = tmp_path / "lib"
    for rel, content in {"zz.py": b"ZZ", "a/b.py": b"AB\xff", "a.py": b"A"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(content)
    config = ml_collections.ConfigDict(
        {
            "seq_len": 2,
            "eval_fraction": 0.5,
            "files": str(root / "**" / "*.py"),
            "cache_dir": str(tmp_path / "c"),
        }
    )
    train, evaluation = text.build_text_sources(config, batch_size=2, seed=0)
    stream = np.concatenate([train.data, evaluation.data])
    assert stream.dtype == np.uint8
    assert stream.tobytes() == text.load_corpus(root=str(root)).tobytes() == b"A\nAB\xff\nZZ"


# ---- the cache -------------------------------------------------------------------------------


def test_the_cache_is_built_once_then_reused_and_rebuilt_when_a_file_changes(
    corpus_dir, tokenizer_dir, monkeypatch, caplog
):
    encoded = []
    real = tokenize.encoded
    monkeypatch.setattr(tokenize, "encoded", lambda *a: encoded.append(1) or real(*a))
    config = _data(corpus_dir, tokenizer_dir)
    with caplog.at_level(logging.INFO, logger="absl"):
        first, _ = _build(config)
        token_cache._OPENED.clear()  # as a second run would
        second, _ = _build(config)
    assert encoded == [1]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 2
    assert lines[0].startswith("data: tokenized 3 files into ") and " tokens in " in lines[0]
    assert lines[1].startswith("data: reusing ") and "tokens of 3 files" in lines[1]
    np.testing.assert_array_equal(first.data, second.data)
    cached = [p for p in os.listdir(config.cache_dir) if p.endswith(".npy")]
    assert len(cached) == 1 and ".tmp" not in cached[0]
    assert _mapped(second.data)  # read in place, not loaded
    # A file that changes (its size or time) is another corpus: built again, beside the first.
    (corpus_dir / "b.txt").write_text(_prose(7, 600))
    token_cache._OPENED.clear()
    third, _ = _build(config)
    assert encoded == [1, 1]
    assert not np.array_equal(third.data, first.data)
    assert len([p for p in os.listdir(config.cache_dir) if p.endswith(".npy")]) == 2


_RACER = """
import sys, time, os
from absl import logging
import mmap
import ml_collections
from mptrain.data import text
logging.set_verbosity(logging.INFO)
config = ml_collections.ConfigDict(dict(seq_len=16, files=sys.argv[1], tokenizer=sys.argv[2],
                                        cache_dir=sys.argv[3]))
open(sys.argv[5], "w").close()  # ready
while not os.path.exists(sys.argv[4]):  # start together
    time.sleep(0.002)
train, _ = text.build_text_sources(config, batch_size=2, seed=0)
print(len(train.data))
"""


def test_two_processes_starting_together_build_the_cache_once(tmp_path, tokenizer_dir):
    (tmp_path / "big.txt").write_text(_prose(3, 400_000))  # about 0.3 s to tokenize
    go, cache = tmp_path / "go", tmp_path / "cache"
    args = [str(tmp_path / "big.txt"), str(tokenizer_dir), str(cache), str(go)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, *args, str(tmp_path / f"ready{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in racers)
        time.sleep(0.01)
    go.touch()
    results = [p.communicate(timeout=60) for p in racers]
    assert all(p.returncode == 0 for p in racers), [err[-2000:] for _, err in results]
    logs = "".join(err for _, err in results)
    assert logs.count("data: tokenized 1 files") == 1, logs
    assert logs.count("data: reusing ") == 1, logs
    assert len({out for out, _ in results}) == 1
    assert sorted(p.rsplit(".", 1)[1] for p in os.listdir(cache)) == ["json", "lock", "npy"]


def _cut_in_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _emptied(path):
    open(path, "wb").close()


def _header_zeroed(path):
    with open(path, "r+b") as f:
        f.write(bytes(64))


def _ids_overwritten(path):  # a valid .npy of the same size: only the checksum tells
    ids = np.load(path, mmap_mode="r+")
    ids[:] = 299  # an id the vocabulary has, so no range check would see it


def _record_lost(path):
    os.remove(path[:-4] + ".json")


@pytest.mark.parametrize(
    "damage", [_cut_in_half, _emptied, _header_zeroed, _ids_overwritten, _record_lost]
)
def test_a_cache_that_does_not_verify_is_built_again_with_a_warning(
    corpus_dir, tokenizer_dir, damage, caplog
):
    """A cache file that a crash, a full disk or a stray write has changed is not read (a
    traceback, or garbage trained on): it is built again, and a warning names it and why."""
    config = _data(corpus_dir, tokenizer_dir)
    first, _ = _build(config)
    expected = np.array(first.data)
    (path,) = [str(p) for p in (corpus_dir.parent / "cache").glob("*.npy")]
    token_cache._OPENED.clear()
    del first
    damage(path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        second, _ = _build(config)
    np.testing.assert_array_equal(second.data, expected)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert len(lines) == 2 and lines[1].startswith("data: tokenized 3 files"), lines
    assert lines[0].startswith(f"data: the token cache {path} does not verify ("), lines
    assert lines[0].endswith("): building it again"), lines
    token_cache._OPENED.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        _build(config)  # the rebuilt file verifies: reused
    assert [r.getMessage()[:14] for r in caplog.records] == ["data: reusing "]


def test_a_broken_cache_that_cannot_be_rebuilt_is_one_line_naming_it(
    corpus_dir, tokenizer_dir, monkeypatch
):
    config = _data(corpus_dir, tokenizer_dir)
    _build(config)
    (path,) = (corpus_dir.parent / "cache").glob("*.npy")
    _emptied(str(path))
    token_cache._OPENED.clear()

    def full_disk(corpus, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(token_cache, "_write", full_disk)
    with pytest.raises(errors.StorageError) as caught:
        _build(config)
    assert str(caught.value) == f"could not write the token cache {path}: No space left on device"


# ---- config checks ---------------------------------------------------------------------------


def _llama(corpus_dir, tokenizer_dir, **overrides):
    data = {f"data.{k}": v for k, v in _data(corpus_dir, tokenizer_dir).items()}
    return load_config("llama3", "tiny", **data, **overrides)


def test_validate_takes_a_tokenizer_that_fits_model_vocab_size(corpus_dir, tokenizer_dir):
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(True)
    assert 256 < vocab <= 300
    config_lib.validate(_llama(corpus_dir, tokenizer_dir, **{"model.vocab_size": vocab}))
    too_small = {"model.vocab_size": vocab - 1}
    message = _error(config_lib.validate, _llama(corpus_dir, tokenizer_dir, **too_small))
    assert message.startswith(f"config.data.tokenizer={str(tokenizer_dir / 'tokenizer.json')!r}")
    assert f"vocabulary of {vocab} tokens exceeds model.vocab_size={vocab - 1}" in message
    assert not os.path.exists(corpus_dir.parent / "cache")  # validating tokenizes nothing
    lm = load_config("default", **{"data.tokenizer": str(tokenizer_dir)})
    assert "exceeds model.vocab_size=256" in _error(config_lib.validate, lm)


def test_a_tokenizer_too_big_for_pretrained_weights_points_at_their_tokenizer():
    """Sweep 2026-12-06, H82: over a folder's weights it said "set model.vocab_size to at least
    1,000", which the weights' 300 rows then refused."""
    from mptrain.data import tokenize

    config = load_config("llama3", "tiny", **{"model.vocab_size": 200, "init_from": "/m/llama"})
    with pytest.raises(ValueError) as e:
        tokenize.check_vocab(config, 256, "bytes")
    assert "the weights of init_from='/m/llama' have 200 rows; use the tokenizer made" in str(
        e.value
    ) and "set model.vocab_size" not in str(e.value)


def test_validate_checks_the_byte_vocabulary_too():
    small = load_config("llama3", "tiny", **{"model.vocab_size": 200})
    message = _error(config_lib.validate, small)
    assert "data.tokenizer='bytes': its vocabulary of 256 tokens exceeds model.vocab_size=200" in (
        message
    )


def test_each_bad_setting_of_text_is_one_line_naming_it(corpus_dir, tokenizer_dir, tmp_path):
    def fails(**keys):
        config = _data(corpus_dir, tokenizer_dir, **keys)
        return _error(text.corpus_of, config)

    assert "data.files=" in fails(files=str(tmp_path / "none*.txt"))
    assert "none*.txt': matches no file" in fails(files=str(tmp_path / "none*.txt"))
    assert "'nothing*' matches no file" in fails(files=[str(corpus_dir / "*.txt"), "nothing*"])
    (tmp_path / "x.docx").write_text("a,b\n")
    assert "x.docx is not one of the files it reads (*.txt" in fails(files=str(tmp_path / "*.docx"))
    assert "must be a glob or a list of globs" in fails(files=[])
    missing = fails(tokenizer=str(tmp_path / "nowhere.json"))
    assert missing.startswith("data.tokenizer=") and "no such file" in missing
    assert "tokenizer.json" in fails(tokenizer=str(corpus_dir))  # a folder without one
    (tmp_path / "bad.json").write_text("{}")
    assert "not a tokenizers file" in fails(tokenizer=str(tmp_path / "bad.json"))
    assert "data.eos_token='<nope>': not a token of " in fails(eos_token="<nope>")
    assert "data.eos_token=" in fails(tokenizer="bytes", eos_token=EOS)
    assert "data.cache_dir=''" in fails(cache_dir="")


def test_a_tokenizer_without_an_end_of_text_token_asks_for_data_eos_token(
    corpus_dir, tokenizer_dir, tmp_path
):
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for entry in spec["added_tokens"]:
        entry["content"] = "<|sep|>"
    spec["model"]["vocab"]["<|sep|>"] = spec["model"]["vocab"].pop(EOS)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = _data(corpus_dir, tmp_path)
    assert "has no end-of-text token" in _error(text.corpus_of, config)
    assert "set data.eos_token" in _error(text.corpus_of, config)
    config.eos_token = "<|sep|>"
    train, evaluation = _build(config)
    assert (
        np.concatenate([train.data, evaluation.data]) == spec["model"]["vocab"]["<|sep|>"]
    ).sum() == 4


def test_unreadable_documents_name_the_file_and_line(corpus_dir, tokenizer_dir):
    jsonl = corpus_dir / "c.jsonl"
    for line, why in (("not json", "not a JSON object"), ('{"txt": 1}', "no string 'text'")):
        jsonl.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
        token_cache._OPENED.clear()
        message = _error(_build, _data(corpus_dir, tokenizer_dir))
        assert isinstance(message, str) and f"{jsonl} line 2: {why}" in message
    jsonl.write_text(json.dumps({"text": "fine"}) + "\n")
    (corpus_dir / "b.txt").write_bytes(b"ok \xff\xfe")
    message = _error(_build, _data(corpus_dir, tokenizer_dir))
    assert f"{corpus_dir / 'b.txt'} is not UTF-8 text (byte 3" in message
    assert not (corpus_dir.parent / "cache").exists()  # the refused build left nothing


# ---- pre-tokenized files ---------------------------------------------------------------------


def _tokens_config(tmp_path, files, **keys):
    config = load_config("llama3", "tiny", **{"data.name": "tokens"})
    config.data.files = files
    config.data.seq_len = 8
    config.data.eval_fraction = 0.25
    for key, value in keys.items():
        config.data[key] = value
    config.batch_size = 4
    return config


def test_token_files_are_memory_mapped_and_concatenated_in_order(tmp_path):
    ids = np.arange(900) % 256
    np.save(tmp_path / "b.npy", ids[400:].astype(np.uint32))
    ids[:400].astype(np.uint16).tofile(tmp_path / "a.bin")
    config = _tokens_config(tmp_path, [str(tmp_path / "*.npy"), str(tmp_path / "*.bin")])
    config_lib.validate(config)
    train, evaluation = tokens.create_sources(config)
    assert train.data.dtype == np.uint32 and len(train.data) == 675
    np.testing.assert_array_equal(train.data[:], ids[:675])  # across the files' seam at 400
    batch = train.get_batch(2)
    for offset, row in zip(train.offsets(2), batch["inputs"], strict=True):
        np.testing.assert_array_equal(row, ids[offset : offset + 8])
    np.testing.assert_array_equal(evaluation.get_batch(0)["inputs"][0], ids[675:683])
    again, _ = tokens.create_sources(config)
    np.testing.assert_array_equal(again.get_batch(2)["targets"], batch["targets"])
    # One .bin of uint32 ids, nanoGPT's layout with data.dtype: read in place.
    ids.astype(np.uint32).tofile(tmp_path / "one.bin")
    one, _ = tokens.create_sources(
        _tokens_config(tmp_path, str(tmp_path / "one.bin"), dtype="uint32")
    )
    assert _mapped(one.data)
    np.testing.assert_array_equal(one.data, ids[:675])


def test_bad_token_files_are_one_line_naming_the_file(tmp_path):
    def fails(name, make, **keys):
        path = tmp_path / name
        make(path)
        config = _tokens_config(tmp_path, str(path), **keys)
        message = _error(config_lib.validate, config)
        assert str(path) in message or "data." in message, message
        os.remove(path)
        return message

    good = lambda p: np.save(p, np.zeros(100, np.uint16))
    assert "holds <i8[100]; token files must be 1-D" in fails(
        "i.npy", lambda p: np.save(p, np.zeros(100, int))
    )
    assert "holds <u2[10, 10]" in fails(
        "m.npy", lambda p: np.save(p, np.zeros((10, 10), np.uint16))
    )
    assert "is not a .npy file" in fails("x.npy", lambda p: p.write_text("hello"))
    assert "has 201 bytes, not a whole number of data.dtype='uint16' ids" in fails(
        "odd.bin", lambda p: p.write_bytes(bytes(201))
    )
    assert "data.dtype='int64': not supported" in fails("g.npy", good, dtype="int64")
    # An id past the model's vocabulary: found when the sources are built.
    path = tmp_path / "big.npy"
    np.save(path, np.full(100, 256, np.uint16))
    config = _tokens_config(tmp_path, str(path))
    config_lib.validate(config)  # headers only
    message = _error(tokens.create_sources, config)
    assert message == f"config.data.files: {path} holds token id 256 >= model.vocab_size=256"
    with pytest.raises(errors.ConfigError):  # exit 2 from the command line
        tokens.create_sources(config)


def test_ids_take_the_narrowest_type_that_holds_the_vocabulary():
    assert [tokenize.token_dtype(v) for v in (256, 257, 65_536, 65_537, 128_256)] == [
        np.uint8,
        np.uint16,
        np.uint16,
        np.uint32,
        np.uint32,
    ]


def test_a_cache_folder_that_cannot_be_made_is_one_line_naming_it(
    corpus_dir, tokenizer_dir, tmp_path
):
    (tmp_path / "plain").write_text("a file, not a folder")
    config = _data(corpus_dir, tokenizer_dir, cache_dir=str(tmp_path / "plain" / "cache"))
    message = _error(_build, config)
    assert message.startswith(f"config.data.cache_dir={str(tmp_path / 'plain' / 'cache')!r}")
    assert "cannot write there" in message


def test_a_llama_3_style_tokenizer_starts_each_document_and_ends_it_with_its_own_tokens(
    corpus_dir, tmp_path
):
    """Llama 3's tokenizer.json prepends <|begin_of_text|> to what it encodes (its template);
    documents keep that and are joined by <|end_of_text|>, found by name."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", EOS]  # both: Llama 3's name wins
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=specials, show_progress=False)
    bpe.train_from_iterator([_prose(0, 300)], trainer)
    bos, eos = bpe.token_to_id(specials[0]), bpe.token_to_id(specials[1])
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{specials[0]} $A", special_tokens=[(specials[0], bos)]
    )
    bpe.save(str(tmp_path / "tokenizer.json"))
    train, evaluation = _build(_data(corpus_dir, tmp_path, files=str(corpus_dir / "*.txt")))
    one_doc = bpe.encode((corpus_dir / "b.txt").read_text()).ids
    assert one_doc[0] == bos
    np.testing.assert_array_equal(np.concatenate([train.data, evaluation.data]), one_doc)
    jsonl = _data(corpus_dir, tmp_path, files=str(corpus_dir / "*.jsonl"), seq_len=4)
    train, evaluation = _build(jsonl)
    stream = np.concatenate([train.data, evaluation.data])
    assert stream[0] == bos and (stream == bos).sum() == 3 and (stream == eos).sum() == 2
    assert list(stream[np.flatnonzero(stream == eos) + 1]) == [bos, bos]
