"""What a checkpoint's meta must hold, and whether the arrays it lists fit a state.

`checkpoint.Checkpointer` saves a JSON meta beside each state: its step, config and policy, the
state's fingerprint, and `arrays`, each array leaf's `"dtype[shape]"` by path
(`fingerprints.array_specs`). The checks here read only that JSON, so a checkpoint that cannot
fit is refused before a byte of its arrays is read: by a resume (the whole state) and by a new
run initialised from it (`init_from`: the params, whose dtype may change on the way in).
"""

from __future__ import annotations

from typing import Any

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
