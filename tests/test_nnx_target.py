"""Bring your own target: a small Flax NNX Llama-style model, defined here and knowing nothing of trees beyond
its cache, positions and a local mask, decodes through ``models.nnx_target`` with every method, each equal to
the model's own greedy decoding (full recompute, no cache, no dtree_jax code)."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from dtree_jax.api import METHODS, Model, generate  # noqa: E402
from dtree_jax.models import drafter, nnx_target  # noqa: E402
from tests.oracles import TINY_TARGET, StateGetter, tiny_domino  # noqa: E402

DIMS = TINY_TARGET  # the random drafter in tests.oracles is built for these shapes


def rope(x, positions, theta):  # x [B, T, N, D], positions [B, T]
    d = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = positions[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    def __init__(self, rngs):
        h, n, kv, d, f = (DIMS[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                             "head_dim", "intermediate_size"))
        self.n, self.kv, self.d = n, kv, d
        self.attn_norm = nnx.RMSNorm(h, epsilon=1e-6, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(h, epsilon=1e-6, rngs=rngs)
        for norm in (self.attn_norm, self.mlp_norm):  # random norm scales, as every parity test here
            norm.scale.value = 0.5 + jax.random.uniform(rngs.params(), (h,))
        self.q = nnx.Linear(h, n * d, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(h, kv * d, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(h, kv * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(n * d, h, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(h, f, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(h, f, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(f, h, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, k_cache, v_cache, lens, local_mask):
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = rope(self.q(y).reshape(b, t, self.n, self.d), positions, DIMS["rope_theta"])
        k = rope(self.k(y).reshape(b, t, self.kv, self.d), positions, DIMS["rope_theta"])
        v = self.v(y).reshape(b, t, self.kv, self.d)
        write = jax.vmap(lambda c, new, at: jax.lax.dynamic_update_slice(c, new, (at, 0, 0)))
        k_cache, v_cache = write(k_cache, k, lens), write(v_cache, v, lens)
        rows = jnp.arange(k_cache.shape[1])
        new = rows[None, :] - lens[:, None]  # [B, L] index among the new tokens
        local = jnp.take_along_axis(local_mask, jnp.clip(new, 0, t - 1)[:, None, :].repeat(t, 1), axis=2)
        visible = (rows[None, None, :] < lens[:, None, None]) | (((new >= 0) & (new < t))[:, None, :] & local)
        kk = jnp.repeat(k_cache, self.n // self.kv, axis=2)
        vv = jnp.repeat(v_cache, self.n // self.kv, axis=2)
        s = jnp.einsum("btnd,blnd->bntl", q, kk) / np.sqrt(self.d)
        p = jax.nn.softmax(jnp.where(visible[:, None], s, -1e30), axis=-1)
        x = x + self.o(jnp.einsum("bntl,blnd->btnd", p, vv).reshape(b, t, -1))
        y = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y)), k_cache, v_cache


class TinyLlama(nnx.Module):
    """Llama-style decoder (RoPE, GQA, SwiGLU, RMSNorm) with a per-layer K/V cache ``[B, L, KV, D]``."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.tok = nnx.Embed(DIMS["vocab_size"], DIMS["hidden_size"], rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(DIMS["num_hidden_layers"])])
        self.norm = nnx.RMSNorm(DIMS["hidden_size"], epsilon=1e-6, rngs=rngs)
        self.norm.scale.value = 0.5 + jax.random.uniform(rngs.params(), (DIMS["hidden_size"],))
        self.head = nnx.Linear(DIMS["hidden_size"], DIMS["vocab_size"], use_bias=False, rngs=rngs)

    def embed(self, tokens):
        return self.tok(tokens)

    def embedding_table(self):
        return self.tok.embedding.value

    def lm_head(self, x):
        return self.head(x).astype(jnp.float32)

    def init_cache(self, batch, max_len):
        shape = (batch, max_len, DIMS["num_key_value_heads"], DIMS["head_dim"])
        return [(jnp.zeros(shape), jnp.zeros(shape)) for _ in self.blocks]

    def __call__(self, tokens, positions, cache, lens, local_mask, taps=()):
        x, out, tapped = self.embed(tokens), [], {}
        for i, (block, (kc, vc)) in enumerate(zip(self.blocks, cache)):
            x, kc, vc = block(x, positions, kc, vc, lens, local_mask)
            out.append((kc, vc))
            tapped[i] = x
        x = self.norm(x)
        tapped[len(self.blocks) - 1] = x
        feats = jnp.concatenate([tapped[i] for i in taps], -1) if taps else x[..., :0]
        return self.lm_head(x), feats, out

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """Its own AR decoding: the whole sequence recomputed causally for every new token (padded to one length,
        so one program serves every step: under the causal mask the padding never reaches the rows read)."""
        length = len(prompt) + n
        step = nnx.jit(lambda model, tokens: model(tokens, jnp.arange(length)[None], model.init_cache(1, length),
                                                   jnp.zeros(1, jnp.int32), jnp.tri(length, dtype=bool)[None])[0])
        seq = list(prompt)
        for _ in range(n):
            logits = step(self, jnp.asarray([seq + [0] * (length - len(seq))]))
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        return seq[len(prompt):]


PROMPTS = [[1, 5, 9, 3], [7, 8, 2, 4, 6, 11, 3, 40, 41]]


@pytest.fixture(scope="module")
def pair():
    module = TinyLlama(seed=2)
    impl, params = nnx_target.split(module)
    target = Model("tiny-llama-nnx", None, params, impl=impl)
    dom, _, dd = tiny_domino(shift_label=True, seed=4)
    dcfg = drafter.config_from_hf(dd, dtype="float32")
    draft = Model("drafter", dcfg, drafter.params_from_hf(dcfg, StateGetter(dom), "float32"))
    return module, target, draft


@pytest.fixture(scope="module")
def own_greedy(pair):
    """The module's own 16 greedy tokens per prompt (a prefix of them is its greedy output for fewer)."""
    return [pair[0].greedy(p, 16) for p in PROMPTS]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_the_models_own_greedy_decoding(pair, own_greedy, method):
    _, target, draft = pair
    got = generate(target, PROMPTS, method, draft if method != "ar" else None, budget=8, max_new_tokens=12,
                   stop_ids=())
    assert got.tokens == [w[:12] for w in own_greedy]


def test_long_accepted_paths_commit_through_the_adapter(pair, own_greedy, monkeypatch):
    """With a drafter that mostly knows the continuation, multi-node paths are accepted and compacted."""
    from dtree_jax import loop, running
    from tests.oracles import oracle_draft

    _, target, draft = pair
    want = own_greedy
    monkeypatch.setattr(loop, "draft", oracle_draft(np.array([w + [0] * 40 for w in want], np.int32), loop.draft))
    monkeypatch.setattr(running, "COMPILED", collections.OrderedDict())
    jax.clear_caches()
    got = generate(target, PROMPTS, "dominotree", draft, budget=8, max_new_tokens=16, stop_ids=())
    jax.clear_caches()
    assert got.tokens == want and min(s["tau"] for s in got.stats) > 2


def test_the_check_can_fail(pair, own_greedy):
    """Control: a model whose cache is read one row off decodes differently from its own greedy output."""
    _, target, draft = pair

    class OffByOne(nnx_target.NNXTarget):
        def forward(self, params, cfg, tokens, positions, cache, lens, local_mask, taps=()):
            return super().forward(params, cfg, tokens, positions, cache, jnp.maximum(lens - 1, 0), local_mask,
                                   taps)

    broken = Model("broken", None, target.params, impl=OffByOne(target.impl.graphdef, target.impl.abstract_params))
    got = generate(broken, PROMPTS, "dominotree", draft, budget=8, max_new_tokens=12, stop_ids=())
    assert got.tokens != [w[:12] for w in own_greedy]


def test_a_module_without_the_contract_is_refused():
    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    with pytest.raises(TypeError, match="has no embed"):
        nnx_target.split(Bare())
