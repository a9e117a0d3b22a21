"""The one table from a drafter checkpoint's ``architectures[0]`` to its family and the dspark-hf classes that load it.

DeepSpec, vLLM and SGLang dispatch on ``architectures[0]`` too; the ``model_type`` a family writes is the target's
(``docs/design.md``, "Checkpoint layout"), so it cannot tell a drafter from a plain model. Everything that picks a
class or a family by architecture (the Auto classes, `hub.load_drafter`, the checkpoint checks in `interop`, the
configs' own readers) reads this table; the standalone custom_generate template, which runs without dspark-hf, has
its own copy of the two names.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DrafterArchitecture:
    """One row of the table.

    family (`str`): ``"qwen3"`` or ``"gemma4"``: which draft layers and which checkpoint tables apply.
    model_type (`str`): the ``model_type`` written in ``config.json`` (the target family's own).
    module (`str`): the dspark-hf module defining `drafter_class`, relative to the package.
    drafter_class (`str`): the [`DSparkDrafter`] (sub)class that loads it.
    """

    family: str
    model_type: str
    module: str
    drafter_class: str


_QWEN3 = DrafterArchitecture("qwen3", "qwen3", "modeling_dspark", "DSparkDrafter")
_GEMMA4 = DrafterArchitecture("gemma4", "gemma4_text", "modeling_dspark_gemma4", "DSparkGemma4Drafter")

# The first architecture of a family is the one written on save; the others are read only.
DRAFTER_ARCHITECTURES: dict[str, DrafterArchitecture] = {
    "Qwen3DSparkModel": _QWEN3,
    "DSparkDraftModel": _QWEN3,  # SGLang's name for the same layout
    "Gemma4DSparkModel": _GEMMA4,
}
# Configs without a known `architectures[0]` are recognised by `model_type` (ours or the one on disk).
_FAMILY_BY_MODEL_TYPE = {"qwen3": "qwen3", "dspark": "qwen3", "gemma4_text": "gemma4", "dspark_gemma4": "gemma4"}


def architectures_of(family: str) -> tuple[str, ...]:
    """The architecture names of `family`, the one written on save first."""
    return tuple(name for name, row in DRAFTER_ARCHITECTURES.items() if row.family == family)


def drafter_family(config: Mapping[str, Any]) -> str:
    """``"qwen3"`` or ``"gemma4"``, from a drafter ``config.json`` dict's ``architectures[0]`` (else its
    ``model_type``); raises `ValueError` for anything else."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture in DRAFTER_ARCHITECTURES:
        return DRAFTER_ARCHITECTURES[architecture].family
    if config.get("model_type") in _FAMILY_BY_MODEL_TYPE:
        return _FAMILY_BY_MODEL_TYPE[config["model_type"]]
    raise ValueError(
        f"Not a DSpark drafter config: architectures={config.get('architectures')}, "
        f"model_type={config.get('model_type')!r} (expected {list(DRAFTER_ARCHITECTURES)})."
    )


def drafter_class_name(architecture: str) -> str:
    """The name of the dspark-hf class that loads `architecture` (e.g. ``"DSparkGemma4Drafter"``)."""
    return DRAFTER_ARCHITECTURES[architecture].drafter_class


def drafter_class(architecture: str | None):
    """The [`DSparkDrafter`] class that loads a checkpoint with this ``architectures[0]``, or `None` when it is not a
    DSpark drafter."""
    row = DRAFTER_ARCHITECTURES.get(architecture)
    if row is None:
        return None
    return getattr(importlib.import_module(f".{row.module}", __package__), row.drafter_class)


__all__ = ["DRAFTER_ARCHITECTURES", "DrafterArchitecture", "architectures_of", "drafter_class", "drafter_class_name",
           "drafter_family"]
