"""Hostile GGUF files (issue 28, untrusted checkpoints): each crafted defect is refused on open with one
``ValueError`` naming the file and the key or tensor, quickly and in bounded memory, and the command prints it
as one line.  Each family has a control showing the check is what stops it: the same bytes handed straight to
``gguf.GGUFReader`` misbehave, or the same file without the defect loads."""

from __future__ import annotations

import resource
import struct
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

from dtree_jax import cli
from dtree_jax.gguf import GGUFCheckpoint, check_gguf_layout

_BLOCK = (  # a dense block's tensors
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip
_TOKENS = ["<|endoftext|>", "<|im_end|>", *(chr(c) for c in range(ord("!"), ord("~") + 1)), "Ġ", "Ġt", "Ġth"]
_MERGES = ["Ġ t", "Ġt h"]


def _refused(path, match: str) -> str:
    """Opens ``path``, which must raise a ValueError naming the file and matching ``match``, within 10 s."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match) as e:
        GGUFCheckpoint(path)
    assert time.perf_counter() - start < 10
    assert str(e.value).startswith(f"{path}: "), e.value
    return str(e.value)


# ----------------------------------------------------------------------------------------------------------
# Files written byte by byte (what GGUFWriter cannot write)


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def _kv(key: str, value_type: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", value_type) + value


def _crafted(kvs: list[bytes], tensor_infos: list[bytes] = (), data: bytes = b"") -> bytes:
    """A GGUF v3 file: header, metadata, tensor infos, padding to 32 bytes, ``data``."""
    counts = struct.pack("<IQQ", 3, len(tensor_infos), len(kvs))
    header = b"GGUF" + counts + b"".join(kvs) + b"".join(tensor_infos)
    return header + b"\0" * (-len(header) % 32) + data


def _huge_array_file(tmp_path, count: int):
    path = tmp_path / "crafted.gguf"
    token_types = struct.pack("<IQ", V.UINT8, count) + b"\1" * 1024  # 1024 items, ``count`` declared
    path.write_bytes(_crafted([_kv("general.architecture", V.STRING, _string("llama")),
                               _kv("tokenizer.ggml.token_type", V.ARRAY, token_types)]))
    return path


def _unguarded_read(path) -> subprocess.CompletedProcess | None:
    """``gguf.GGUFReader(path)`` in a subprocess limited to 5 s and 2 GiB: its result, None if out of time."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    try:
        return subprocess.run([sys.executable, "-c", f"import gguf; gguf.GGUFReader({str(path)!r})"],
                              capture_output=True, timeout=5, preexec_fn=limit_memory,
                              env={"OPENBLAS_NUM_THREADS": "1", "PATH": ""})
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("count", [10**9, 2**64 - 1])
def test_a_huge_declared_array_is_refused_before_reading(count, tmp_path):
    path = _huge_array_file(tmp_path, count)
    _refused(path, rf"crafted\.gguf: .*'tokenizer\.ggml\.token_type' declares {count} array items")


def test_control_the_unguarded_reader_does_not_finish_on_a_huge_array(tmp_path):
    out = _unguarded_read(_huge_array_file(tmp_path, 10**9))
    assert out is None or (out.returncode != 0 and b"gguf_reader.py" in out.stderr), out  # no time or memory


def test_a_string_past_the_end_of_the_file_is_refused(tmp_path):
    path = tmp_path / "crafted.gguf"
    name = struct.pack("<Q", 10**6) + b"x" * 64  # declares 1 MB, holds 64 bytes
    path.write_bytes(_crafted([_kv("general.architecture", V.STRING, _string("llama")),
                               _kv("general.name", V.STRING, name)]))
    _refused(path, r"crafted\.gguf: cannot read GGUF file \(metadata 'general\.name' .*truncated or corrupt")
    strings = struct.pack("<IQ", V.STRING, 3) + _string("a") + struct.pack("<Q", 10**6) + b"b" * 64
    path.write_bytes(_crafted([_kv("tokenizer.ggml.tokens", V.ARRAY, strings)]))
    _refused(path, r"crafted\.gguf: .*'tokenizer\.ggml\.tokens': string 1 of 1000000 bytes runs past the end")


def test_control_the_crafted_layout_is_otherwise_valid(tmp_path):
    """The byte-by-byte writer's files pass when their declared sizes are true."""
    path = tmp_path / "crafted.gguf"
    token_types = struct.pack("<IQ", V.INT32, 2) + struct.pack("<ii", 1, 3)
    info = _string("output_norm.weight") + struct.pack("<IQIQ", 1, 4, gguf.GGMLQuantizationType.F32, 0)
    path.write_bytes(_crafted([_kv("general.architecture", V.STRING, _string("llama")),
                               _kv("general.name", V.STRING, _string("x" * 64)),
                               _kv("tokenizer.ggml.token_type", V.ARRAY, token_types)],
                              [info], np.arange(4, dtype=np.float32).tobytes()))
    check_gguf_layout(path)
    reader = gguf.GGUFReader(str(path))
    assert reader.get_field("tokenizer.ggml.token_type").contents() == [1, 3]
    assert reader.get_field("general.name").contents() == "x" * 64
    assert reader.tensors[0].data.tolist() == [0, 1, 2, 3]


# ----------------------------------------------------------------------------------------------------------
# Tensor data ranges


def _one_tensor_file(path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("one tensor")
    w.add_tensor("token_embd.weight", np.arange(16, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _patch_offset(path, offset: int) -> None:
    """Sets the data offset in the tensor info of ``token_embd.weight`` (1 dim, F32) to ``offset``."""
    data = bytearray(path.read_bytes())
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 8 + 4  # n_dims, dims, type
    struct.pack_into("<Q", data, at, offset)
    path.write_bytes(bytes(data))


def test_a_wrapping_tensor_offset_is_refused(tmp_path):
    path = tmp_path / "crafted.gguf"
    _one_tensor_file(path)
    _patch_offset(path, 2**64 - 64)
    _refused(path, r"crafted\.gguf: cannot read GGUF file \(tensor 'token_embd\.weight': "
                   r"offset 18446744073709551552 puts its 64 bytes at \[\d+, \d+\), past the end of the file")


def test_control_the_unguarded_reader_reads_header_bytes_as_weights(tmp_path):
    path = tmp_path / "crafted.gguf"
    _one_tensor_file(path)
    check_gguf_layout(path)
    _patch_offset(path, 2**64 - 64)
    with np.errstate(over="ignore"):
        reader = gguf.GGUFReader(str(path))  # no error
    raw = path.read_bytes()
    (tensor,) = reader.tensors
    assert tensor.data.tobytes() == raw[reader.data_offset - 64 : reader.data_offset]  # the header's tail


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path):
    path = tmp_path / "crafted.gguf"
    _one_tensor_file(path)
    _patch_offset(path, 32)  # 64 bytes from 32 past the data start: 32 bytes past the end
    _refused(path, r"crafted\.gguf: .*'token_embd\.weight': offset 32 puts its 64 bytes .* past the end")
    _one_tensor_file(path)
    path.write_bytes(path.read_bytes()[:-1])
    _refused(path, r"crafted\.gguf: .*tensor 'token_embd\.weight': .*truncated or corrupt")


# ----------------------------------------------------------------------------------------------------------
# The config and the tokenizer


def _model_file(path, *, block_count=1, heads=2, tokens=_TOKENS, eos=1) -> None:
    """A llama file: its config, a byte-level vocabulary and one block's tensors (tiny placeholders)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(_MERGES)
    w.add_eos_token_id(eos)
    for name in ("token_embd.weight", "output_norm.weight", *(f"blk.0.{n}.weight" for n in _BLOCK)):
        w.add_tensor(name, np.ones(8, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_config_sizes_are_checked_before_use(tmp_path):
    path = tmp_path / "crafted.gguf"
    _model_file(path, block_count=4_000_000_000)
    _refused(path, r"crafted\.gguf: GGUF metadata llama\.block_count = 4000000000 is not a positive integer")
    _model_file(path, block_count=40)  # within the limit, but 40 blocks cannot live in 11 tensors
    _refused(path, r"crafted\.gguf: GGUF metadata llama\.block_count = 40 needs 360 tensors or more")
    _model_file(path, heads=0)
    _refused(path, r"crafted\.gguf: GGUF metadata llama\.attention\.head_count = 0 is not a positive integer")


def test_control_sane_sizes_and_a_unique_vocabulary_load(tmp_path):
    path = tmp_path / "good.gguf"
    _model_file(path)
    ckpt = GGUFCheckpoint(path)
    config = ckpt.config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]) == (1, 2, 4)
    assert ckpt.generation_config() == {"eos_token_id": 1}
    tok = ckpt.tokenizer()
    assert tok.decode(tok.encode("hi there").ids) == "hi there"


@pytest.mark.parametrize("duplicate, spelled, first", [("i", "i", 2 + ord("i") - ord("!")),
                                                        (" ", "Ġ", len(_TOKENS) - 3)])
def test_a_vocabulary_with_a_duplicated_token_is_refused(duplicate, spelled, first, tmp_path):
    """A token twice (or " " beside "Ġ", its byte-level spelling) would lose an id, and text with it."""
    path = tmp_path / "crafted.gguf"
    _model_file(path, tokens=[*_TOKENS, duplicate])
    _refused(path, rf"crafted\.gguf: GGUF metadata tokenizer\.ggml\.tokens holds the token {spelled!r} "
                   rf"twice: ids {first} .* and {len(_TOKENS)} ")


def test_an_eos_id_outside_the_vocabulary_is_refused(tmp_path):
    path = tmp_path / "crafted.gguf"
    _model_file(path, eos=len(_TOKENS))
    _refused(path, rf"crafted\.gguf: GGUF metadata tokenizer\.ggml\.eos_token_id = {len(_TOKENS)} is not a "
                   rf"token id of the vocabulary \(0 to {len(_TOKENS) - 1}\)")


def test_the_cli_says_it_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DTREE_JAX_CACHE", str(tmp_path / "cache"))
    path = _huge_array_file(tmp_path, 2**64 - 1)
    assert cli.main(["generate", "--target", str(path), "--method", "ar", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("dtree-jax: error: ")]
    assert errors == lines[-1:] and f"{path}: " in errors[0], err
    assert "'tokenizer.ggml.token_type'" in errors[0]
    assert "Traceback" not in err
