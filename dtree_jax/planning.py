"""Planning a generation before anything compiles: the drafter fits the target, the requests are valid token
ids within the target's positions, the memory fits the device, and the knobs become the loop's static ``Spec``
(``make_spec``); ``budget="auto"`` chooses the method and budget from tau and this machine's round costs
(``choose_auto``).  Every check raises a ValueError naming what to change.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtree_jax import builders, checkpoint_files, cpu_options, loop, round_costs
from dtree_jax.cost import auto_budget, choose_budget, load_calibration, parse_taus
from dtree_jax.loading import Model
from dtree_jax.models import sharding
from dtree_jax.models.drafter import DraftVocab

DRAFT_VOCAB_FILE = "draft_vocab.json"  # beside a drafter: {"token_ids": [...], ...} (experiments/draft_vocab.py)


def check_fit(target: Model, drafter: Model) -> None:
    """ValueError naming both checkpoints unless ``drafter`` was built for ``target``'s shapes: the same
    embedding table ``[V, H]``, tap layers inside the target, a mask token inside the vocabulary, and the
    target depth the drafter states (``num_target_layers``)."""
    if target.is_drafter:
        raise ValueError(f"{target.path or 'the target'} is a DFlash/Domino drafter, not a target model")
    vocab, hidden = target.embedding_shape
    dcfg = drafter.cfg
    layers = getattr(target.cfg, "num_layers", None)
    problems = []
    if (dcfg.model.vocab_size, dcfg.model.hidden_size) != (vocab, hidden):
        problems.append(f"vocabulary x hidden {dcfg.model.vocab_size} x {dcfg.model.hidden_size} != the target's "
                        f"{vocab} x {hidden}")
    if not 0 <= dcfg.mask_token_id < vocab:
        problems.append(f"mask token {dcfg.mask_token_id} is outside the target's vocabulary ({vocab})")
    if layers is not None and any(not 0 <= i < layers for i in dcfg.target_layer_ids):
        problems.append(f"tap layers {list(dcfg.target_layer_ids)} are outside the target's {layers} layers")
    if layers is not None and dcfg.num_target_layers not in (None, layers):
        problems.append(f"it was trained for a {dcfg.num_target_layers}-layer target, this one has {layers}")
    if problems:
        raise ValueError(f"the drafter {drafter.path or ''} does not fit the target {target.path or ''}: "
                         + "; ".join(problems))


def check_token_ids(ids, vocab: int, what: str) -> None:
    """ValueError unless ``ids`` are integers (not bools or floats) in ``[0, vocab)``."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what}: token ids must be integers in [0, {vocab}), got {bad[:5]}")


def device_memory_bytes() -> int:
    """Memory of this process's first device: its allocator's limit on accelerators, physical memory on CPU."""
    import os

    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_estimate(spec: loop.Spec, target: Model, drafter: Model | None, batch: int, prompt_bucket: int = 0
                    ) -> dict:
    """A generation's memory per device in bytes, from shapes alone (params may be abstract): the params and
    caches as the sharding table splits them over ``spec.mesh``, a round's logits (target, softmax, drafter
    block) and tree mask + one layer's attention scores for each device's requests and heads, and the prefill
    of ``prompt_bucket`` tokens (one layer's attention scores, their softmax and the MLP's activations)."""
    mesh = spec.mesh if spec.mesh is not None else sharding.make_mesh(devices=jax.devices()[:1])
    nbytes = lambda tree, cfg: sharding.per_device_bytes(tree, mesh, cfg)  # noqa: E731  one device's share
    n, cache_len = spec.num_nodes, spec.cache_len
    vocab = target.embedding_shape[0]
    rows = -(-batch // sharding.axis_size(mesh, sharding.DATA))  # requests per device
    heads = getattr(spec.target_cfg, "num_heads", 1)
    model = sharding.axis_size(mesh, sharding.MODEL)
    heads = heads // model if heads % model == 0 else heads
    est = dict(
        params=nbytes(target.params, target.cfg) + (
            nbytes(drafter.params, drafter.cfg) if spec.drafter_cfg is not None else 0),
        cache=nbytes(jax.eval_shape(lambda: target.module.init_cache(spec.target_cfg, batch, cache_len)),
                     target.cfg),
        logits=3 * rows * n * vocab * 4,
        tree=rows * n * n + 4 * rows * n * (cache_len + n) * heads,
        prefill=4 * rows * prompt_bucket * (3 * heads * prompt_bucket + 3 * _intermediate(spec.target_cfg) // model),
    )
    if spec.drafter_cfg is not None:
        est["cache"] += nbytes(jax.eval_shape(
            lambda: spec.drafter.init_drafter_cache(spec.drafter_cfg, batch, cache_len)), drafter.cfg)
    return est


def _intermediate(cfg) -> int:
    """The widest MLP activation per token of a target config (dense, or every routed expert's of a MoE)."""
    routed = (getattr(cfg, "num_experts_per_tok", 0) or 0) * (getattr(cfg, "moe_intermediate_size", 0) or 0)
    return max(getattr(cfg, "intermediate_size", 0) or 0, getattr(cfg, "hidden_size", 0) or 0, routed)


def check_memory(spec: loop.Spec, target: Model, drafter: Model | None, batch: int, fraction: float = 0.8,
                 prompt_bucket: int = 0) -> dict:
    """``memory_estimate`` before anything is compiled; raises a ValueError naming the knob to lower when it
    exceeds ``fraction`` of the device's memory.  Returns the estimate (bytes)."""
    est = memory_estimate(spec, target, drafter, batch, prompt_bucket)
    limit = fraction * device_memory_bytes()
    if sum(est.values()) > limit:
        biggest = max(est, key=est.get)
        knob = dict(params="a smaller model or dtype, or a mesh", cache="max_new_tokens, the prompt length or the batch",
                    logits="budget or the batch", tree="budget or the batch",
                    prefill="the prompt length or the batch")[biggest]
        raise ValueError(
            f"this generation needs about {sum(est.values()) / 2**30:.1f} GiB per device ({biggest}: "
            f"{est[biggest] / 2**30:.1f} GiB) but the device has {limit / fraction / 2**30:.1f} GiB; lower {knob}")
    return est


def request_keys(seed: int, batch: int) -> jax.Array:  # [batch] keys
    """Request ``i``'s random stream: ``fold_in(key(seed), i)``, so a request's sample depends on the seed and
    its index, never on the other requests of its batch."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(batch))


def draft_vocabulary(target: Model, drafter: Model | None, draft_vocab, mesh=None) -> DraftVocab | None:
    """``generate``'s ``draft_vocab``: "auto" (the drafter's ``DRAFT_VOCAB_FILE`` where the weights are baked
    in, ``cpu_options.bakes_weights``; else every token), None (every token), or the token ids themselves (only
    where the weights are baked in: elsewhere the drafter reads the target's whole head, so ValueError)."""
    if draft_vocab is None or drafter is None:
        return None
    baked = cpu_options.bakes_weights(mesh, target.params, drafter.params)
    if isinstance(draft_vocab, str):
        if draft_vocab != "auto":
            raise ValueError(f"draft_vocab must be 'auto', None or a sequence of token ids, got {draft_vocab!r}")
        if not baked or drafter.path is None or not checkpoint_files.present(drafter.path, DRAFT_VOCAB_FILE):
            return None
        try:
            return DraftVocab.of(checkpoint_files.read_json(drafter.path, DRAFT_VOCAB_FILE).get("token_ids"),
                                 target.embedding_shape[0])
        except ValueError as e:
            raise ValueError(f"{drafter.path}/{DRAFT_VOCAB_FILE}: {e}") from None
    if not baked:
        raise ValueError("draft_vocab: a draft vocabulary applies where the weights are baked in (the CPU backend, "
                         "no mesh, weights up to cpu_options.BAKE_LIMIT_BYTES); here the drafter reads the whole head")
    return DraftVocab.of(draft_vocab, target.embedding_shape[0])


def bucket(n: int, multiple: int = 16) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def _check_drafter(record: builders.Method, target: Model, drafter: Model | None) -> None:
    if drafter is None:
        raise ValueError(f"method {record.name!r} needs a drafter")
    if not drafter.is_drafter:
        raise ValueError(f"the drafter checkpoint is a {drafter.kind!r} model, not a DFlash/Domino drafter")
    if record.needs_head and not drafter.cfg.has_head:
        raise ValueError(f"method {record.name!r} needs a Domino drafter (with the GRU head); this is plain DFlash")
    check_fit(target, drafter)


def make_spec(
    target: Model,
    drafter: Model | None,
    method: str,
    *,
    budget: int,
    node_topk: int,
    corr_topm: int | None,
    max_depth: int | None,
    max_new_tokens: int,
    prompt_bucket: int,
    stop_ids: Sequence[int],
    top_k: int,
    top_p: float,
    cache_len: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    stream: bool = False,
    draft_vocab: DraftVocab | None = None,
    cpu_kernel: bool = True,
) -> loop.Spec:
    """Validates the knobs and returns the static description of a generation (on ``mesh``, if given);
    ``draft_vocab`` (``draft_vocabulary``) is kept only for methods that draft.  ``cpu_kernel``: where the
    program bakes its weights in on the CPU, its dense dots run ``cpu_dot``'s few-row kernel (where it builds
    here); False keeps XLA's dots (``choose_auto`` picks it where measured faster)."""
    record = builders.get_method(method)
    if record.drafts:
        _check_drafter(record, target, drafter)
    for name, v in dict(budget=budget, node_topk=node_topk, max_new_tokens=max_new_tokens).items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    corr_topm = record.corr_topm if corr_topm is None else corr_topm
    if not isinstance(corr_topm, int) or corr_topm < 0:
        raise ValueError(f"corr_topm must be a non-negative integer (0 = full vocabulary), got {corr_topm!r}")
    if top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    dcfg = drafter.cfg if record.drafts else None
    depth_cap = dcfg.num_draft_rows if dcfg is not None else 1
    max_depth = depth_cap if max_depth is None else max_depth
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive integer, got {max_depth!r}")
    spec = loop.Spec(
        target=target.module,
        target_cfg=target.cfg,
        drafter=drafter.module if record.drafts else None,
        drafter_cfg=dcfg,
        method=method,
        budget=budget,
        node_topk=node_topk,
        corr_topm=corr_topm,
        max_depth=min(max_depth, depth_cap),
        max_new_tokens=max_new_tokens,
        cache_len=0,
        stop_ids=tuple(int(s) for s in stop_ids),
        top_k=top_k,
        top_p=float(top_p),
        mesh=mesh,
        stream=stream,
        draft_vocab=draft_vocab if record.drafts else None,
        cpu_kernel=bool(cpu_kernel),
    )
    need = prompt_bucket + max_new_tokens + spec.draft_span
    if cache_len is None:
        cache_len = bucket(need, 64)
    elif cache_len < prompt_bucket + spec.draft_span:
        raise ValueError(f"cache_len {cache_len} cannot hold a {prompt_bucket}-token prompt bucket plus one round")
    return dataclasses.replace(spec, cache_len=cache_len)


CPU_DOTS = ("auto", "kernel", "xla")  # ``generate(cpu_dots=)``: which dense dots baked CPU programs run


class AutoChoice(NamedTuple):
    """What ``budget="auto"`` chose (``choose_auto``)."""

    method: str  # "ar" where no tree pays for itself here
    budget: int
    why: str  # one line
    cpu_kernel: bool  # the dots of the choice (``make_spec``)
    ar_cpu_kernel: bool  # the dots of the fastest plain-ar step measured here: a fair ar baseline runs them


def choose_auto(target: Model, drafter: Model | None, method: str, calibration, knobs: dict,
                inputs: tuple, cpu_dots: str = "auto") -> AutoChoice:
    """``budget="auto"``.  Tau per budget comes from the calibration (``calibration``, else the drafter's
    ``calibration.json``); seconds per round from ``calibration["round_seconds"]`` when the caller passed a
    calibration holding them, else measured on this machine at this batch and cached (``round_costs``).  Budget
    0 is plain ar: where no tree pays for itself here, ar runs.  ``cpu_dots`` "auto": where the weights are baked
    in and ``cpu_dot``'s kernel builds here, the rounds are measured with it and with XLA's dots, and the choice
    takes the dots that gave the most tokens/s; "kernel" / "xla" measure those alone."""
    record = builders.get_method(method)
    fixed = cpu_dots != "xla"  # the dots where nothing is measured or only one kind is
    if not record.tree:
        return AutoChoice(method, 1, f"budget auto: {method} drafts a chain, no budget to choose", fixed, fixed)
    cal = load_calibration(calibration, drafter and drafter.path)
    batch = int(inputs[0].shape[0])
    kernel = ar_kernel = fixed
    if calibration is not None and isinstance(cal, dict) and "round_seconds" in cal:
        budget = auto_budget(cal, batch)
        why = "from the given calibration's round_seconds"
    else:
        taus = parse_taus(cal)
        from dtree_jax.convert import cache_dir

        dparams = drafter.params if drafter is not None else None
        both = cpu_dots == "auto" and cpu_options.runs_kernel(knobs.get("mesh"), target.params, dparams)
        names, kinds = {True: "the few-row kernel", False: "XLA's dots"}, ((True, False) if both else (fixed,))
        variants = {names[kernel]: {b: make_spec(target, drafter if b else None, method if b else "ar",
                                                 budget=max(b, 1), cpu_kernel=kernel, **knobs) for b in taus}
                    for kernel in kinds}
        with sharding.mesh_context(knobs.get("mesh")):
            measured, source = round_costs.seconds_per_round(variants, target.params, dparams, inputs, taus,
                                                             cache_dir())
        options = {}  # cpu_kernel -> (tokens/s, budget, seconds per round by budget)
        for kernel in kinds:
            seconds = measured[names[kernel]]
            budget = choose_budget(batch, {b: taus[b] for b in seconds}, lambda _, n, s=seconds: s[n - 1])
            options[kernel] = (batch * taus[budget] / seconds[budget], budget, seconds)
        kernel = max(options, key=lambda k: options[k][0])  # a tie keeps the kernel
        ar_kernel = min(options, key=lambda k: (options[k][2][0], not k))  # the fastest ar step (tie: the kernel)
        _, budget, seconds = options[kernel]
        rate = lambda b: batch * taus[b] / seconds[b]  # noqa: E731
        ar_seconds = options[ar_kernel][2][0]
        why = (f"expected {rate(budget):.1f} tok/s (tau {taus[budget]:.2f}, {seconds[budget] * 1e3:.0f} ms a round) vs "
               f"ar {batch * taus[0] / ar_seconds:.1f} tok/s ({ar_seconds * 1e3:.0f} ms), "
               + ", ".join(f"budget {b} {rate(b):.1f}" for b in sorted(seconds) if b not in (0, budget))
               + f"; round costs {'measured now on this machine' if source == 'measured now' else 'of this machine from ' + source}")
        if both:
            other_rate, other_budget = options[not kernel][:2]
            other = f"budget {other_budget}" if other_budget else "ar"
            why += f"; dots: {names[kernel]}, where {names[not kernel]} gave {other_rate:.1f} tok/s ({other})"
            if ar_kernel != kernel:
                why += f"; plain ar's step is faster with {names[ar_kernel]}"
    if budget == 0:
        return AutoChoice("ar", 1, f"budget auto: plain ar at batch {batch}, no tree pays for itself here; {why}",
                          kernel, ar_kernel)
    return AutoChoice(method, budget, f"budget auto: {method} budget {budget} at batch {batch}; {why}", kernel,
                      ar_kernel)


@dataclasses.dataclass(frozen=True)
class Requests:
    """A batch of requests as the compiled generation takes them."""

    prompts: list[list[int]]  # token ids per request
    inputs: tuple  # (padded prompts [B, prompt_bucket] int32, lens [B] int32, keys [B]), on the mesh when given
    temperature: jax.Array  # [] fp32
    prompt_bucket: int
    stop_ids: tuple[int, ...]
    text: bool  # the prompts were strings (the results then carry decoded texts)


def encode_requests(target: Model, prompts, *, chat: bool, stop_ids, temperature, seed, max_new_tokens,
                    prompt_bucket: int | None, mesh) -> Requests:
    """Validates and encodes ``generate``'s requests: strings through the target's tokenizer (``chat``: one user
    message each, in the chat template), ids checked against the vocabulary and the target's positions, prompts
    right-padded to ``prompt_bucket`` (default: the longest rounded up to 16), one random stream per request."""
    text = bool(prompts) and all(isinstance(p, str) for p in prompts)
    if chat and not text:
        raise ValueError("chat=True needs text prompts (one user message per prompt)")
    if text:
        from dtree_jax.text import encode_prompts

        prompts = encode_prompts(target.path, prompts, chat=chat)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and every prompt needs at least one token")
    vocab = target.embedding_shape[0]
    for i, p in enumerate(prompts):
        check_token_ids(p, vocab, f"prompt {i}")
    stop_ids = target.eos_token_ids if stop_ids is None else stop_ids
    check_token_ids(stop_ids, vocab, "stop_ids")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer from 0 to 2**32 - 1, got {seed!r}")
    longest = max(len(p) for p in prompts)
    _check_positions(target, longest, max_new_tokens)
    prompt_bucket = bucket(longest) if prompt_bucket is None else prompt_bucket
    if prompt_bucket < longest:
        raise ValueError(f"prompt_bucket {prompt_bucket} is shorter than the longest prompt ({longest})")
    padded = np.zeros((len(prompts), prompt_bucket), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    inputs = [jnp.asarray(padded), jnp.asarray([len(p) for p in prompts], jnp.int32), request_keys(seed, len(prompts))]
    if mesh is not None:
        inputs = [sharding.put(x, sharding.batch_sharding(mesh, x.shape)) for x in inputs]
    return Requests([list(p) for p in prompts], tuple(inputs), jnp.float32(temperature), prompt_bucket,
                    tuple(int(s) for s in stop_ids), text)


def _check_positions(target: Model, longest: int, max_new_tokens) -> None:
    max_positions = getattr(target.cfg, "max_position_embeddings", None)
    if max_positions and isinstance(max_new_tokens, int) and longest + max_new_tokens > max_positions:
        raise ValueError(f"a {longest}-token prompt plus max_new_tokens={max_new_tokens} exceeds the target's "
                         f"{max_positions} positions (max_position_embeddings); shorten the prompt or lower "
                         "max_new_tokens")
