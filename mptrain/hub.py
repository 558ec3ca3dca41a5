"""A model named by its Hub id, `ORG/NAME` or `ORG/NAME@REVISION`, wherever mptrain takes a
HuggingFace folder: `configs/hf.py:ID` (and `sft=`, `dpo=`, `grpo=`), `init_from`,
`data.tokenizer`, `python -m mptrain.generate --hf=ID` and the plan's `--config`.

`folder(name, files)` is the local folder to read: `name` itself where a file or folder of that
name exists (a local directory wins, as in transformers), else the snapshot that
`huggingface_hub.snapshot_download` resolves through its cache (`HF_HOME`, `HF_HUB_CACHE`):
cache first, what is missing downloaded when online (its progress bars on the terminal),
`HF_HUB_OFFLINE=1` honoured. Only the files the caller reads are asked for (`files`): a plan
needs `config.json` alone (`CONFIG`), a tokenizer its files (`TOKENIZER`), a run's base its
weights (`WEIGHTS`), never a repository's other files (`.bin`, `.gguf`, ONNX, ...).

A dataset's files go the same way: `data.files` may be `hf://datasets/ORG/NAME[@REVISION]/GLOB`
(`dataset_globs`), the form huggingface_hub's `HfFileSystem` reads, or the dataset alone for its
train split (its test split in `data.eval_files`); the files are fetched into the dataset's
snapshot and read from disk as local files are (a corpus is then streamed from local disk, a
record batch at a time, not over the network).

An id that resolves to nothing is one line, exit 2 (`errors.ConfigError`), naming the flag, the
id and the cache looked in, and why: offline and not cached, the Hub unreachable, no such
repository or revision. transformers raises an `OSError` of several sentences; the reason here
is the same, the key that led there named first.
"""

from __future__ import annotations

import os
import re

from mptrain import errors

CONFIG = ("config.json",)
TOKENIZER = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)  # fmt: skip
WEIGHTS = (*CONFIG, "generation_config.json", "*.safetensors", "model.safetensors.index.json")
EVERYTHING = (*WEIGHTS, *TOKENIZER)  # a model to decode text with: `mptrain.generate --hf`

# huggingface_hub's repository ids: an owner and a name of letters, digits, '-', '_', '.'; a
# revision (branch, tag or commit) after '@'
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[\w./-]+))?")


_FILES = (".json", ".jsonl", ".safetensors", ".txt", ".py")


def parse(name: str) -> tuple[str, str | None] | None:
    """`(repository, revision or None)` where `name` is a Hub id and no local path; else None."""
    if not isinstance(name, str) or os.path.exists(os.path.expanduser(name)):
        return None
    if name.endswith(_FILES):  # a file's path that is not there, not a repository
        return None
    found = _ID.fullmatch(name)
    return None if found is None else (found["repo"], found["revision"])


def folder(name: str, files: tuple[str, ...], flag: str) -> str:
    """The local folder `name` names (the module doc): itself, or its Hub snapshot holding
    `files` (glob patterns). `flag` (`config.init_from`, `--hf`, ...) names it in errors."""
    parsed = parse(name)
    if parsed is None:
        return name
    where = f"{flag}={name!r}: no such folder here, and as a Hub id"
    return _snapshot(*parsed, files, where)


# Where a dataset repository keeps a split's files, as `datasets` finds them without a script:
# `data/train-00000-of-00001.parquet`, `train.jsonl`, `train/...`, or the Hub's own Parquet
# conversion's `default/train/0000.parquet`
SPLIT_PATTERNS = (
    "{split}.*", "{split}-*", "{split}/**", "data/{split}.*", "data/{split}-*", "data/{split}/**",
    "*/{split}/**",
)  # fmt: skip


def dataset_globs(url: str, flag: str) -> list[str]:
    """Local globs for `hf://datasets/ORG/NAME[@REVISION][/GLOB]` (in `flag`, `data.files` or
    `data.eval_files`): the files of the dataset repository that GLOB matches, or without one
    the split's (`SPLIT_PATTERNS`: "train" for `data.files`, "test" for `data.eval_files`, as
    TRL's `dataset_train_split` and `dataset_test_split` default), in its snapshot in the Hub's
    cache (downloaded there when online and missing), then read from disk as any local file.
    A `ConfigError` naming `flag` where the URL is not of that form or the files cannot be
    had."""
    found = re.fullmatch(r"hf://datasets/([^/@]+/[^/@]+)(?:@([^/]+))?(?:/(.+))?", url)
    if found is None:
        raise errors.ConfigError(
            f"{flag}={url!r}: a Hub dataset's files are hf://datasets/ORG/NAME[@REVISION][/GLOB]"
        )
    repo, revision, pattern = found.groups()
    split = "test" if flag.endswith("eval_files") else "train"
    patterns = [pattern] if pattern else [p.format(split=split) for p in SPLIT_PATTERNS]
    where = f"{flag}={url!r}: the dataset {repo}" + ("" if pattern else f"'s {split} split")
    snapshot = _snapshot(repo, revision, patterns, where, "dataset")
    return [os.path.join(snapshot, p) for p in patterns]


def _snapshot(repo: str, revision, files, where: str, kind: str = "model") -> str:
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as hub_errors

    cache = f"its cache {constants.HF_HUB_CACHE}"
    try:
        return huggingface_hub.snapshot_download(
            repo, revision=revision, allow_patterns=list(files), repo_type=kind
        )
    except hub_errors.RevisionNotFoundError:
        raise errors.ConfigError(
            f"{where}: the Hub has no revision {revision!r} of {repo}"
        ) from None
    except hub_errors.GatedRepoError:
        why = "is gated: log in with a token that has access"
        raise errors.ConfigError(f"{where}: {repo} {why}") from None
    except hub_errors.RepositoryNotFoundError:
        why = "is not on the Hub, or is private and no token with access is set (HF_TOKEN)"
        raise errors.ConfigError(f"{where}: {repo} {why}") from None
    except hub_errors.IncompleteSnapshotError:
        why = f"{cache} holds a partial download of {files}, and the Hub cannot be reached"
        raise errors.ConfigError(f"{where}: {why}") from None
    except hub_errors.LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            why = f"not in {cache}, and HF_HUB_OFFLINE=1 forbids downloading it"
        else:
            cause = e.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause else "no network"
            why = f"not in {cache}, and the Hub ({constants.ENDPOINT}) could not be reached"
            why += f" ({reason})".splitlines()[0]
        raise errors.ConfigError(f"{where}: {why}") from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        raise errors.ConfigError(f"{where}: {type(e).__name__}: {e}".splitlines()[0]) from None


def cached(name: str, file: str) -> bool:
    """Whether the Hub id `name`'s snapshot in the cache holds `file` (nothing is fetched)."""
    parsed = parse(name)
    if parsed is None:
        return False
    import huggingface_hub

    found = huggingface_hub.try_to_load_from_cache(parsed[0], file, revision=parsed[1])
    return isinstance(found, str)
