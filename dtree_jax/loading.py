"""Loading models for the API: ``Model`` (a loaded target or drafter), ``load_model`` (from a checkpoint path,
a tuple or a ``Model``, optionally placed on a mesh), the CPU layout of a tied output head, kernel overrides.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from dtree_jax import checkpoint_files
from dtree_jax.models import families, sharding


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: ``kind`` names its family in ``models.families`` ("qwen3" / "qwen2" / "llama"
    (dense), "qwen3_5", "drafter"), or ``impl`` is its own ``TargetModel`` implementation (a hashable object;
    ``kind`` is then a free label).  ``cfg`` is static."""

    kind: str
    cfg: Any
    params: Any
    path: str | None = None  # where it was loaded from (tokenizer lookup)
    eos_token_ids: tuple[int, ...] = ()  # from config.json / generation_config.json
    impl: Any = None  # a TargetModel implementation replacing the kind's module

    @property
    def embedding_shape(self) -> tuple[int, int]:
        """``(V, H)`` of the target's embedding table (through the protocol, for any implementation)."""
        return tuple(jnp.shape(self.module.embed_table(self.params)))

    @property
    def module(self):
        return self.impl if self.impl is not None else families.module(self.kind)

    @property
    def is_drafter(self) -> bool:
        """Whether this is a drafter (its family's), not a target."""
        return self.impl is None and families.family(self.kind).drafter


def eos_ids(path) -> tuple[int, ...]:
    """EOS ids from ``generation_config.json`` (preferred) or ``config.json`` (an int or a list of ints, also
    under ``text_config``), read through ``checkpoint_files``; a ValueError naming the file for any other value."""
    for name in ("generation_config.json", "config.json"):
        if checkpoint_files.present(path, name):
            d = checkpoint_files.read_json(path, name)
            d = d.get("text_config", d) if "eos_token_id" not in d and isinstance(d.get("text_config"), dict) else d
            eos = d.get("eos_token_id")
            if eos is not None:
                eos = eos if isinstance(eos, list) else [eos]
                if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
                    raise ValueError(f"{pathlib.Path(path) / name}: eos_token_id must be a token id or a list of "
                                     f"them, got {d['eos_token_id']!r}")
                return tuple(eos)
    return ()


def load_model(model, mesh=None) -> Model | None:
    """A ``Model`` from a checkpoint path (converted or HF directory, or a GGUF file: its converted copy in the
    cache), a ``(kind, cfg, params)`` tuple, or a ``Model``; None stays None.  With a ``mesh`` (``Mesh``,
    ``"data=2,model=4"`` or a dict; see ``models.sharding``) the params are placed on it with their table
    shardings: a converted checkpoint is restored straight into its shards."""
    mesh = sharding.as_mesh(mesh)
    if model is None:
        return None
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from dtree_jax import convert

        path = convert.model_dir(model, weights=mesh is None)  # with a mesh a GGUF file streams into its shards
        kind, cfg, params = convert.load_model(model, mesh=mesh)
        return cpu_layout(Model(kind, cfg, params, str(path), eos_ids(path)), mesh)
    if isinstance(model, tuple) and len(model) == 3:
        model = Model(*model)
    if not isinstance(model, Model):
        raise TypeError(f"expected a Model, a (kind, cfg, params) tuple or a checkpoint path, got "
                        f"{type(model).__name__}")
    return model if mesh is None else dataclasses.replace(model, params=sharding.place(model.params, mesh, model.cfg))


def cpu_layout(model: Model, mesh=None) -> Model:
    """On the CPU backend, a loaded target with tied embeddings gets its output head as its own contiguous
    ``[H, V]`` copy of the table (``DecoderParams.lm_head``; placed on ``mesh`` with the table's sharding when
    given).  The logits are the same; XLA:CPU's matmuls read ``[H, V]`` faster than the transposed ``[V, H]``
    table (SmolLM2-135M's 49,152 x 576 head, 5 rows on 2 cores: 6.4 ms instead of 8.7), for a second copy of
    the table in memory, so accelerators keep the tied table.  Drafters, custom implementations and untied
    targets are returned as they are."""
    params = model.params
    if model.impl is not None or model.is_drafter or jax.default_backend() != "cpu":
        return model
    if getattr(params, "lm_head", 0) is not None:  # untied already (or no such field)
        return model
    head = None
    if mesh is not None:
        table = jax.ShapeDtypeStruct(params.embed.shape[::-1], params.embed.dtype)
        head = sharding.shardings(dataclasses.replace(params, lm_head=table), mesh, model.cfg).lm_head
    lm_head = jax.jit(jnp.transpose, out_shardings=head)(params.embed)
    return dataclasses.replace(model, params=dataclasses.replace(params, lm_head=lm_head))


def with_kernels(model: Model | None, attention_impl: str | None = None, kernel_platform: str | None = None):
    """``model`` with its config's ``attention_impl`` ("xla" | "pallas") and ``kernel_platform`` ("tpu" | "gpu" |
    "cpu"; whose kernels "pallas" runs) replaced where given (None keeps the config's; a drafter's apply to its
    backbone).  ``models.kernels`` documents which kernel runs where."""
    if model is None or (attention_impl is None and kernel_platform is None):
        return model
    from dtree_jax.models.config import ATTENTION_IMPLS, check_kernel_platform

    if attention_impl is not None and attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    check_kernel_platform(kernel_platform)
    knobs = {k: v for k, v in dict(attention_impl=attention_impl, kernel_platform=kernel_platform).items() if v}
    cfg = model.cfg
    if model.is_drafter:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **knobs))
    else:
        cfg = dataclasses.replace(cfg, **knobs)
    return dataclasses.replace(model, cfg=cfg)


def model_for_mesh(model: Model | None, mesh) -> Model | None:
    """``model`` with its config set up for ``mesh`` (``sharding.for_mesh``: the KV cache's head layout)."""
    if model is None or mesh is None:
        return model
    return dataclasses.replace(model, cfg=sharding.for_mesh(model.cfg, mesh))


def load_pair(target, drafter, mesh, attention_impl: str | None = None, kernel_platform: str | None = None
              ) -> tuple[Model, Model | None]:
    """``load_model`` of both (set up for ``mesh``), with the kernel overrides of ``with_kernels``; ValueError
    when the target is a drafter."""
    target, drafter = model_for_mesh(load_model(target, mesh), mesh), model_for_mesh(load_model(drafter, mesh), mesh)
    if target.is_drafter:
        raise ValueError(f"{target.path or 'the target'} is a DFlash/Domino drafter, not a target model; pass it as "
                         "the drafter")
    return with_kernels(target, attention_impl, kernel_platform), with_kernels(drafter, attention_impl, kernel_platform)
