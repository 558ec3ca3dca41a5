"""What a checkpoint's meta must hold, and whether the arrays it lists fit a state.

`checkpoint.Checkpointer` saves a JSON meta beside each state: its step, config and policy, the
state's fingerprint, and `arrays`, each array leaf's `"dtype[shape]"` by path
(`fingerprints.array_specs`). The checks here read only that JSON, so a checkpoint that cannot
fit is refused before a byte of its arrays is read: by a resume (the whole state) and by a new
run initialised from it (`init_from`: the params, whose dtype may change on the way in).
`check_resumable` says whether a config may continue a checkpoint (the same model and policy).
"""

from __future__ import annotations

from typing import Any

from absl import logging

from mptrain import errors

# What a meta holds; without it a meta is corrupt, skipped like corrupt arrays (not a KeyError).
REQUIRED = dict(step=int, fingerprint=str, arrays=dict, config=dict | None, policy=str | None)


def problem(meta: Any, step: int) -> str | None:
    """Why a checkpoint's meta is unusable, or None."""
    if not isinstance(meta, dict):
        return f"a JSON {type(meta).__name__}, not an object"
    for key, kind in REQUIRED.items():
        if isinstance(value := meta.get(key), bool) or not isinstance(value, kind):
            return f"{key} is {str(value)[:40]!r}" if key in meta else f"it holds no {key}"
    return f"it says step {meta['step']}" if meta["step"] != step else None


def _shape(spec: str | None) -> str | None:
    return None if spec is None else spec[spec.index("[") :]


def differences(saved: dict[str, str], wanted: dict[str, str], *, dtypes: bool = True) -> list:
    """`"path: saved S, expected W"` for each leaf path whose spec differs between `saved` and
    `wanted` (`array_specs`' form; "nothing" where one side lacks the path), the wanted paths
    first; `dtypes=False` compares shapes alone."""
    same = (lambda a, b: a == b) if dtypes else (lambda a, b: _shape(a) == _shape(b))
    return [
        f"{path}: saved {saved.get(path, 'nothing')}, expected {wanted.get(path, 'nothing')}"
        for path in list(wanted) + [p for p in saved if p not in wanted]
        if not same(saved.get(path), wanted.get(path))
    ]


def shown(diffs: list[str], limit: int = 5) -> str:
    """The first `limit` of `differences`, joined, and how many more there are."""
    more = f"; and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def check_resumable(meta: dict, policy: str, config: dict, where: str, tell: bool = True) -> None:
    """Raises `ConfigError` when `config` cannot continue the checkpoint at `where`. A model key
    that only one of the two configs has (another mptrain version's) is not a difference. A key
    changed that may change is said once, as a warning, where `tell` (the resume's check; the
    early check before the state is built passes False)."""
    saved, new = (meta.get("config") or {}).get("model"), config.get("model")
    both = set(saved) & set(new) if isinstance(saved, dict) and isinstance(new, dict) else ()
    changed = changes(meta.get("config") or {}, config)
    model = [key for key in changed if key.startswith("model.") and key.split(".")[1] in both]
    model += [key for key in changed if key.startswith("lora.") and key != "lora.dropout"]
    step, wanted, problem = meta["step"], config.get("num_train_steps"), None
    if meta.get("policy") not in (None, policy):
        problem = (
            f"config.precision={config.get('precision')!r}: the checkpoint {where} was trained "
            f"with precision '{meta['policy']}', the config asks for '{policy}'; resuming would "
            "recast the master params. Resume with the old precision"
        )
    elif model:
        (old, new), more = changed[model[0]], len(model) - 1
        problem = (
            f"config.{model[0]}={new!r}: the checkpoint {where} was trained with {model[0]}="
            f"{old!r}{f' (and {more} more model keys)' if more else ''}; its weights would be "
            f"misread by another model. Resume with --config.{model[0]}={old!r}"
        )
    elif layout := _fp8_layout(meta.get("config") or {}, config, policy):
        key, old, new = layout
        problem = (
            f"config.fp8.{key}={new!r}: the checkpoint {where} was trained with fp8.{key}="
            f"{old!r}; its fp8 scaling state has another layout (which matmuls run in fp8, how "
            f"many amaxes each keeps). Resume with --config.fp8.{key}={old!r}"
        )
    elif changed.get("dpo.reference", (None,))[0] is not None:
        old, new = changed["dpo.reference"]
        problem = (
            f"config.dpo.reference={new!r}: the checkpoint {where} was trained with "
            f"dpo.reference={old!r}; step 0 fixed that reference (a copy of the weights in the "
            f"state, sums computed ahead, or the adapters off). Resume with "
            f"--config.dpo.reference={old!r}"
        )
    elif isinstance(wanted, int) and wanted < step:
        problem = (
            f"config.num_train_steps={wanted}: the checkpoint {where} is at step {step} already; "
            f"resume with num_train_steps >= {step}"
        )
    if problem:
        raise errors.ConfigError(f"{problem}, or use another --workdir to start a new run")
    for key, (old, new) in changed.items() if tell else ():
        logging.warning(
            "mptrain: config.%s changed since the checkpoint: %r -> %r; the run goes on with %r",
            key, old, new, new,
        )  # fmt: skip


def _fp8_layout(saved: dict, config: dict, policy: str) -> tuple[str, Any, Any] | None:
    """`(key, saved value, new value)` of the first `fp8.*` setting, as the recipe resolves it
    (an unset key at the model's default), that shapes the fp8 state and changed; else None."""
    if not policy.endswith(",fp8"):
        return None
    from mptrain import models
    from mptrain.recipe import fp8

    defaults = lambda c: getattr(models.record_of(c), "fp8", None)
    old, new = (fp8.from_config(c.get("fp8") or {}, defaults(c)) for c in (saved, config))
    for key in ("bf16_layers", "min_size", "history"):
        if getattr(old, key) != getattr(new, key):
            return key, getattr(old, key), getattr(new, key)
    return None


def changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """`{dotted key: (old value, new value)}` for each key that differs between two config dicts.
    A tuple equals the list with its items (a config read back from JSON has lists)."""
    found = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found |= changes(a, b, f"{prefix}{key}.")
        elif _listed(a) != _listed(b):
            found[f"{prefix}{key}"] = (a, b)
    return found


def _listed(value: Any) -> Any:
    return [_listed(v) for v in value] if isinstance(value, tuple | list) else value
