"""What a model of the zoo can do, as data: its `Record`.

Each model module declares one (`RECORD`), and every question about a model's capabilities is
asked of it, never of the model's name: which mesh axes beyond data and FSDP it splits over and
what those need of its settings (`check_mesh`), whether it decodes with a KV cache (`generate`,
`sample.prompts`, `plan --decode`), reads and writes HuggingFace folders (`init_from`,
`export --format=hf|peft`), takes low-rank adapters, runs its projections in fp8 and with which
defaults, and whether it is a language model (tokens in, its own mean cross-entropy over the
target tokens out: the loss unit, the chunked head, the plan's knobs). torchtitan's
`ModelSpec` is the anchor; `mptrain.models.record_of` finds the record of `config.model.name`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

MESH_AXES = ("expert", "context", "tensor")  # the axes a model must declare it splits over
# what a model that does not split over an axis is told, by axis
NOT_SPLIT = {
    "expert": "has no experts to split over devices",
    "context": "does not take a split sequence",
    "tensor": "does not split its layers over a tensor axis",
}


@dataclasses.dataclass(frozen=True)
class Record:
    """A model's capabilities (the module doc). A model takes `create_model(model_config,
    compute_dtype)`, and the keyword arguments its capabilities add: `backend`, `host_memory`
    and `loss` (a language model), `lora` (adapters), `fp8` (fp8 matmuls)."""

    name: str  # config.model.name
    language_model: bool = False
    adapters: bool = False
    # fp8 matmuls: the values an unset `fp8.*` key takes for this model (empty: the recipe's
    # own); None: no fp8
    fp8: Mapping[str, Any] | None = None
    mesh: frozenset[str] = frozenset()  # of MESH_AXES
    decodes: bool = False
    hf: bool = False
    # `(config, model, example) -> None`: what a layout over `mesh` needs of the model's
    # settings and the data (`example`: one example's shapes, or None); a ValueError naming the
    # keys where it cannot take it
    check_mesh: Callable[[Any, Any, Any], None] | None = None

    def __post_init__(self):
        if self.fp8 is not None:
            object.__setattr__(self, "fp8", MappingProxyType(dict(self.fp8)))
        unknown = set(self.mesh) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"Record {self.name!r}: unknown mesh axes {sorted(unknown)}")
        object.__setattr__(self, "mesh", frozenset(self.mesh))

    def options(self) -> frozenset[str]:
        """The keyword arguments its `create_model` takes beyond the config and the dtype."""
        found = {"backend", "host_memory", "loss"} if self.language_model else set()
        found |= {"lora"} if self.adapters else set()
        return frozenset(found | ({"fp8"} if self.fp8 is not None else set()))
