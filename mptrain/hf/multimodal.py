"""Multimodal folders whose text model is one of `mptrain.hf.families` (Gemma 3's): its config
under `text_config`, its tensors under a prefix (transformers 4's `language_model.model.` and
5's `model.language_model.`), the rest (the vision tower, its projector, a tied head) left out.
mptrain reads the text model, as the text-only folder's would be; an export writes that
text-only folder."""

from __future__ import annotations

from pathlib import Path

from mptrain import errors

# the multimodal architecture -> (its text model's, the prefixes of the text model's tensors)
NESTED = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        ("language_model.model.", "model.language_model."),
    ),
}
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_VISION += ("model.multi_modal_projector.", "language_model.lm_head.")


def text(file: Path, raw: dict) -> dict:
    """`raw` itself, or where it is a multimodal folder's (`NESTED`) its text model's config as
    the text-only folder's would be."""
    nested = [a for a in raw.get("architectures") or () if a in NESTED]
    if not nested:
        return raw
    inner = raw.get("text_config")
    if not isinstance(inner, dict):
        raise errors.ConfigError(f"{file}: {nested[0]} without a text_config object")
    return {**inner, "architectures": [NESTED[nested[0]][0]]}


def tensor_name(raw: dict, name: str) -> str | None:
    """A multimodal folder's tensor `name` as its text model's folder names it, None where it
    is not the text model's (the vision tower's, a tied head); a text-only folder's as it is."""
    nested = [a for a in raw.get("architectures") or () if a in NESTED]
    if not nested:
        return name
    for prefix in NESTED[nested[0]][1]:
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return None if name.startswith(_VISION) else name
