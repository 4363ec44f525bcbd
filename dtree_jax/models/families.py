"""The model-family registry: one ``Family`` record per family of checkpoints we read, the one place that
says which HF configs a family reads, which module implements it and how its checkpoint keys are named.

A family's module provides the converter's contract: ``config_from_hf(d, **overrides)`` (static config),
``hf_shapes(cfg)`` (canonical HF key -> shape: the weight contract), ``params_from_hf(cfg, get, dtype)`` and
``abstract_params(cfg, dtype)``; a target family's module also satisfies ``models.protocol.TargetModel`` and a
drafter family's ``models.protocol.DrafterModel``.  The logical axes of its params' leaves (for a mesh) are in
``models.sharding``'s table.  Adding a family is one ``register_family(Family(...))`` (the built-in ones are
below), plus its module and tests; README "Adding a target family" walks through it.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Family:
    """One family of models.

    ``name``: the model kind (``Model.kind``) of its checkpoints, or with ``kind_is_model_type`` the config's
    ``model_type`` is the kind (one module for several HF model types whose switches it reads from the config).
    ``module``: the implementing module's import path (imported on first use).  ``model_types``: the HF
    ``model_type`` values it reads; ``architectures`` / ``config_keys``: markers that claim a config whatever its
    ``model_type`` (a DFlash drafter's config says ``"qwen3"``).  ``drafter``: a drafter family, not a target.
    ``renamed_prefixes``: checkpoint key prefix -> canonical prefix (the first that matches); ``skipped_prefixes``:
    checkpoint keys that are not read (a vision tower, an MTP head)."""

    name: str
    module: str
    model_types: tuple[str, ...] = ()
    kind_is_model_type: bool = False
    architectures: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    drafter: bool = False
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """The ``Model.kind`` values this family serves."""
        return self.model_types if self.kind_is_model_type else (self.name,)

    def claims(self, config: Mapping) -> bool:
        """Whether an HF config dict is one of this family's (markers first, then ``model_type``); a
        ValueError when ``architectures`` is not a list of strings."""
        from dtree_jax.models.config import config_strs  # here: models.config imports this module

        if set(config_strs(config, "architectures", default=())) & set(self.architectures):
            return True
        if any(k in config for k in self.config_keys):
            return True
        return not self.architectures and not self.config_keys and config.get("model_type") in self.model_types

    def kind_of(self, config: Mapping) -> str:
        return config.get("model_type") if self.kind_is_model_type else self.name

    def canonical_key(self, key: str) -> str | None:
        """A checkpoint key as the family's ``hf_shapes`` names it; None for a tensor that is not read."""
        if key.startswith(self.skipped_prefixes):
            return None
        for old, new in self.renamed_prefixes:
            if key.startswith(old):
                return new + key.removeprefix(old)
        return key

    def load(self) -> ModuleType:
        """The implementing module; ValueError naming it when this build of dtree_jax lacks it."""
        try:
            return importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name != self.module:
                raise
            raise ValueError(
                f"model kind {self.name!r} needs {self.module}, which this dtree_jax build does not have"
            ) from e


FAMILIES: dict[str, Family] = {}  # by name, in registration order (marker families before model types)


def register_family(family: Family) -> Family:
    """Adds ``family`` to the registry; ValueError if its name, a kind or a model type is taken.  Returns it."""
    if not isinstance(family, Family):
        raise ValueError(f"expected a Family, got {family!r}")
    taken = {k: f.name for f in FAMILIES.values() for k in f.kinds}
    types = {t: f.name for f in FAMILIES.values() if not (f.architectures or f.config_keys) for t in f.model_types}
    clash = [k for k in (family.name, *family.kinds) if k in FAMILIES or k in taken]
    if not (family.architectures or family.config_keys):
        clash += [t for t in family.model_types if t in types]
    if clash:
        raise ValueError(f"family {family.name!r}: {sorted(set(clash))} already registered")
    FAMILIES[family.name] = family
    return family


def family(kind: str) -> Family:
    """The family serving model kind ``kind``; ValueError naming the known kinds otherwise."""
    for f in FAMILIES.values():
        if kind in f.kinds:
            return f
    raise ValueError(f"unknown model kind {kind!r} (known: {sorted(known_kinds())})")


def known_kinds() -> tuple[str, ...]:
    return tuple(k for f in FAMILIES.values() for k in f.kinds)


def target_kinds() -> tuple[str, ...]:
    return tuple(k for f in FAMILIES.values() if not f.drafter for k in f.kinds)


def kind_of(config: Mapping, config_file: str = "config.json") -> str:
    """The model kind of an HF config dict (a family with markers claims it first); ValueError otherwise."""
    ordered = sorted(FAMILIES.values(), key=lambda f: not (f.architectures or f.config_keys))
    for f in ordered:
        try:
            claimed = f.claims(config)
        except ValueError as e:  # a malformed marker (``architectures``)
            raise ValueError(f"{config_file}: {e}") from None
        if claimed:
            return f.kind_of(config)
    supported = [t for f in FAMILIES.values() if not f.drafter for t in f.model_types]
    drafters = " or ".join(f.name for f in FAMILIES.values() if f.drafter)
    raise ValueError(
        f"{config_file}: unknown model_type {config.get('model_type')!r} (supported: "
        f"{', '.join(map(repr, supported))}{', or a ' + drafters if drafters else ''})"
    )


def module(kind: str) -> ModuleType:
    """The module implementing model kind ``kind``."""
    return family(kind).load()


DENSE = register_family(Family(
    "decoder", "dtree_jax.models.decoder", model_types=("qwen3", "qwen3_moe", "qwen2", "llama"),
    kind_is_model_type=True,
))
HYBRID = register_family(Family(
    "qwen3_5", "dtree_jax.models.qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"),
    renamed_prefixes=(("model.language_model.", "model."),),  # the ConditionalGeneration layout
    skipped_prefixes=("model.visual.", "mtp."),  # the vision tower, the MTP head
))
DRAFTER = register_family(Family(
    "drafter", "dtree_jax.models.drafter", architectures=("DFlashDraftModel",), config_keys=("dflash_config",),
    drafter=True, renamed_prefixes=(("model.", ""),),  # model.-prefixed and bare keys
))
