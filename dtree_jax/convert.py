"""HF / PyTorch / GGUF checkpoints -> dtree_jax params, and orbax save/restore of converted models.

An HF model directory holds ``config.json`` and weights as ``model.safetensors``, a sharded set named by
``model.safetensors.index.json``, other ``*.safetensors`` files, or PyTorch ``*.bin``/``*.pt`` pickles
(only these need torch).  A ``*.gguf`` file (llama.cpp) carries its config, tokenizer and (quantised)
weights in one file; ``dtree_jax.gguf`` presents it as such a checkpoint, and ``model_dir`` converts it once
into a cache directory (``cache_dir``) that later runs reuse.  The model kind comes from the config
(``model_kind``); each family's module (``models.families``) provides ``config_from_hf(d)``, ``hf_shapes(cfg)``
(canonical HF key -> shape), ``params_from_hf(cfg, get, dtype)`` and ``abstract_params(cfg, dtype)``.
Checkpoint keys are mapped to canonical keys (``Family.canonical_key``; GGUF tensor names by the GGUF reader) and
checked against ``hf_shapes`` (missing / unexpected / wrong shape) before any tensor is read; tensors are then
read (GGUF: dequantised) one at a time, so peak host memory is about the converted params plus one tensor.

``convert`` writes ``out/target/`` and ``out/drafter/``, each with ``config.json``, tokenizer files,
``params/`` (orbax, ``StandardCheckpointHandler``) and ``dtree_jax.json`` (kind and dtype); ``load_converted``
restores one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dtree_jax import checkpoint_files
from dtree_jax.cost import CALIBRATION_FILE
from dtree_jax.models import families, moe

DTYPES = ("bfloat16", "float16", "float32")
INPUT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)
META_FILE = "dtree_jax.json"
PARAMS_DIR = "params"
_NON_WEIGHT_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt")  # Trainer outputs beside weights
_TIED_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


# ----------------------------------------------------------------------------------------------------------
# Config and model kind


def read_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of a model directory (or that JSON file itself), read through
    ``checkpoint_files`` (inside the directory, a regular file, size-capped)."""
    path = Path(path)
    if path.suffix == ".json" and path.is_file():
        return checkpoint_files.read_json(path.parent, path.name)
    if not checkpoint_files.present(path, "config.json"):
        raise ValueError(f"{path / 'config.json'}: not found (expected a model directory with config.json)")
    return checkpoint_files.read_json(path, "config.json")


def model_kind(config: dict, config_file: str | Path = "config.json") -> str:
    """The model kind of an HF config (``models.families``: a drafter, a dense ``model_type`` such as
    ``"qwen3"`` / ``"qwen2"`` / ``"llama"``, or ``"qwen3_5"`` for the hybrid GDN targets)."""
    return families.kind_of(config, str(config_file))


def _config_from_hf(module: ModuleType, config: dict, config_file: Path, dtype: Any = None) -> Any:
    """``module.config_from_hf(config)`` with its errors (e.g. an unknown projector_type) naming the file;
    ``dtype`` sets the compute dtype, which always matches the params' dtype."""
    try:
        if dtype is None:
            return module.config_from_hf(config)
        return module.config_from_hf(config, dtype=np.dtype(dtype).name)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_file}: {type(e).__name__}: {e}") from e


def _dtype(dtype: Any, config: dict) -> np.dtype:
    """``dtype`` (None: the config's ``dtype``/``torch_dtype``, also under ``text_config``, else float32)."""
    for d in (config, config.get("text_config") or {}):
        dtype = dtype or d.get("dtype") or d.get("torch_dtype")
    dtype = dtype or "float32"
    try:
        resolved = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of {DTYPES})") from e
    if resolved.name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (expected one of {DTYPES})")
    return resolved


# ----------------------------------------------------------------------------------------------------------
# Checkpoint readers


@contextlib.contextmanager
def _file_errors(file: Path, what: str):
    """Re-raises a reader's exception (anything but ValueError) as a ValueError naming ``file``."""
    try:
        yield
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{file}: cannot {what} ({type(e).__name__}: {e}); truncated or corrupt?") from e


class _SafetensorsFile:
    def __init__(self, file: Path):
        from safetensors import safe_open

        self.file = file
        with _file_errors(file, "open safetensors file"):
            self._handle = safe_open(str(file), framework="numpy")
            self._keys = list(self._handle.keys())

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        with _file_errors(self.file, f"read the header of {key!r}"):
            return tuple(self._handle.get_slice(key).get_shape())

    def read(self, key: str, index: int | None = None) -> np.ndarray:
        """The tensor ``key``, or only its ``index``-th row block (``x[index]``, read alone)."""
        with _file_errors(self.file, f"read {key!r}"):
            return self._handle.get_tensor(key) if index is None else self._handle.get_slice(key)[index]


class _TorchFile:
    def __init__(self, file: Path):
        try:
            import torch
        except ImportError as e:
            raise ValueError(
                f"{file}: reading PyTorch .bin/.pt checkpoints needs torch (pip install torch); "
                "safetensors checkpoints need no torch"
            ) from e
        self.file, self._torch = file, torch
        import zipfile

        # mmap needs the zip format (torch >= 1.6); a legacy (pre-zip) file is read into memory instead.
        with _file_errors(file, "load PyTorch checkpoint"):
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
        if not isinstance(state, dict):
            raise ValueError(f"{file}: expected a state dict, got {type(state).__name__}")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{file}: {key!r} is a {type(value).__name__}, not a tensor")
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state[key].shape)

    def read(self, key: str, index: int | None = None) -> np.ndarray:
        with _file_errors(self.file, f"read {key!r}"):
            t = (self._state[key] if index is None else self._state[key][index]).contiguous()
            if t.dtype == self._torch.bfloat16:
                return t.view(self._torch.uint16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()


def _open_file(file: Path) -> _SafetensorsFile | _TorchFile:
    file = checkpoint_files.confined(file.parent, file.name)
    return _SafetensorsFile(file) if file.suffix == ".safetensors" else _TorchFile(file)


class CheckpointReader:
    """The tensors of one HF checkpoint directory, read lazily one at a time (file handles kept per shard).

    ``source`` is what error messages name for keys that are absent: the index file or the directory.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._where: dict[str, Path] = {}  # checkpoint key -> file
        self._files: dict[Path, _SafetensorsFile | _TorchFile] = {}
        index = self.path / "model.safetensors.index.json"
        if checkpoint_files.present(self.path, index.name):
            self.source = index
            self._read_index(index)
            return
        self.source = self.path
        single = self.path / "model.safetensors"
        files = [single] if single.is_file() else sorted(self.path.glob("*.safetensors"))
        files = files or sorted(
            f for f in [*self.path.glob("*.bin"), *self.path.glob("*.pt")] if f.name not in _NON_WEIGHT_FILES
        )
        if not files:
            raise ValueError(f"{self.path}: no checkpoint weights (*.safetensors, *.bin or *.pt)")
        for file in files:
            handle = self._files[file] = _open_file(file)
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(f"{file}: key {key!r} also stored in {self._where[key]}")
                self._where[key] = file
        self._unfuse_experts()

    def _unfuse_experts(self) -> None:
        """Fused MoE experts (``models.moe.unfused_keys``) are listed as the per-expert keys they hold, each
        read as its own slice of the fused tensor."""
        self._experts = moe.unfused_keys(self._where, self._num_experts)
        for key, (fused, _, _) in self._experts.items():
            if key in self._where:
                raise ValueError(f"{self._where[key]}: expert key {key!r} is also held by the fused {fused!r}")
            self._where[key] = self._where[fused]
        for fused in {f for f, _, _ in self._experts.values()}:
            del self._where[fused]

    def _read_index(self, index: Path) -> None:
        weight_map = checkpoint_files.read_json(self.path, index.name).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: invalid safetensors index (weight_map must map keys to file names)")
        for key, name in weight_map.items():
            file = self.path / str(name)
            if file not in self._files:
                if not (self.path / str(name)).exists():
                    raise ValueError(f"{index}: shard {name!r} holding {key!r} not found")
                self._files[file] = _open_file(checkpoint_files.confined(self.path, str(name)))
            if key not in self._files[file].keys():
                raise ValueError(f"{file}: key {key!r} listed in {index.name} is not in this shard")
            self._where[key] = file
        self._unfuse_experts()

    def _num_experts(self, fused: str) -> int:
        shape = self.shape(fused)
        if len(shape) != 3 or (fused.endswith("gate_up_proj") and shape[1] % 2):
            raise ValueError(f"{self._where[fused]}: fused experts {fused!r} have shape {shape}; expected "
                             "[experts, 2 * intermediate, hidden] (gate_up_proj) or [experts, hidden, intermediate]")
        return shape[0]

    def keys(self) -> list[str]:
        return list(self._where)

    def canonical(self, kind: str, key: str) -> str | None:
        return families.family(kind).canonical_key(key)

    def file(self, key: str) -> Path:
        return self._where[key]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in getattr(self, "_experts", {}):
            fused, _, part = self._experts[key]
            _, rows, cols = self._files[self._where[key]].shape(fused)
            return (rows // 2, cols) if part != "down" else (rows, cols)
        return self._files[self._where[key]].shape(key)

    def read(self, key: str) -> np.ndarray:
        if key in self._experts:
            fused, expert, part = self._experts[key]
            return moe.expert_part(self._files[self._where[key]].read(fused, expert), part)
        return self._files[self._where[key]].read(key)

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------
# HF -> params


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


@dataclasses.dataclass(frozen=True)
class HFModel:
    """An HF model directory's (or GGUF file's) config, resolved kind, model module and static config."""

    path: Path
    config: dict
    kind: str
    module: ModuleType
    cfg: Any
    gguf: Any = None  # the open ``gguf.GGUFCheckpoint`` when ``path`` is a GGUF file

    @property
    def config_file(self) -> Path:
        return self.path if self.gguf is not None else self.path / "config.json"

    @classmethod
    def open(cls, path: str | Path) -> HFModel:
        path = Path(path).absolute()
        ckpt = None
        if is_gguf(path):
            from dtree_jax.gguf import GGUFCheckpoint

            ckpt = GGUFCheckpoint(path)
            config, config_file = ckpt.config, path
        else:
            config, config_file = read_config(path), path / "config.json"
        kind = model_kind(config, config_file)
        module = families.module(kind)
        return cls(path, config, kind, module, _config_from_hf(module, config, config_file), ckpt)


@dataclasses.dataclass(frozen=True)
class ReadStats:
    keys: int
    bytes: int
    seconds: float


def _match_keys(kind: str, reader: Any, expected: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Canonical key -> checkpoint key, after checking the keys and header shapes against ``expected``
    (``reader``: a ``CheckpointReader`` or a ``gguf.GGUFCheckpoint``)."""
    raw_of: dict[str, str] = {}
    for raw in reader.keys():
        key = reader.canonical(kind, raw)
        if key is None:
            continue
        if key in raw_of:
            raise ValueError(f"{reader.file(raw)}: keys {raw_of[key]!r} and {raw!r} both map to {key!r}")
        raw_of[key] = raw
    if _TIED_HEAD in raw_of and _TIED_HEAD not in expected and _EMBED in expected and _EMBED in raw_of:
        head = raw_of.pop(_TIED_HEAD)
        if not np.array_equal(reader.read(head), reader.read(raw_of[_EMBED])):
            raise ValueError(
                f"{reader.file(head)}: key {head!r} differs from {raw_of[_EMBED]!r} but the config ties them "
                "(tie_word_embeddings)"
            )

    def listing(keys: list[str]) -> str:
        more = f" (and {len(keys) - 1} more: {', '.join(keys[1:6])}{', ...' if len(keys) > 6 else ''})"
        return repr(keys[0]) + (more if len(keys) > 1 else "")

    unexpected = sorted(raw_of.keys() - expected.keys())
    if unexpected:
        raws = [raw_of[k] for k in unexpected]
        raise ValueError(f"{reader.file(raws[0])}: unexpected key {listing(raws)} for a {kind} model")
    missing = sorted(expected.keys() - raw_of.keys())
    if missing:
        raise ValueError(f"{reader.source}: missing key {listing(missing)} for a {kind} model")
    for key, shape in expected.items():
        got = reader.shape(raw_of[key])
        if got != tuple(shape):
            raise ValueError(
                f"{reader.file(raw_of[key])}: key {raw_of[key]!r} has shape {got}, expected {tuple(shape)}"
            )
    return raw_of


def read_params(
    model: HFModel, dtype: Any = None, *, progress: bool = True, mesh: Any = None
) -> tuple[Any, ReadStats]:
    """Validates and converts ``model``'s checkpoint (one tensor at a time) to its params pytree; with a
    ``mesh`` each leaf goes into its shards (``models.sharding``) as soon as it is read, so the host never
    holds more than one leaf (a stacked or regrouped leaf: the tensors it is built from)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    dtype = _dtype(dtype, model.config)
    expected = model.module.hf_shapes(model.cfg)
    opened = contextlib.nullcontext(model.gguf) if model.gguf is not None else CheckpointReader(model.path)
    with opened as reader:
        raw_of = _match_keys(model.kind, reader, expected)
        done: set[str] = set()
        nbytes = 0
        bar = tqdm(
            total=len(expected),
            desc=f"{model.kind} {model.path.name}",
            unit="tensor",
            leave=False,
            disable=not progress or not sys.stderr.isatty(),
        )

        def get(key: str) -> np.ndarray:
            nonlocal nbytes
            if key not in raw_of:
                raise KeyError(f"{model.kind} model asked for {key!r}, which its hf_shapes does not list")
            raw = raw_of[key]
            array = reader.read(raw)
            if array.dtype not in INPUT_DTYPES:
                raise ValueError(
                    f"{reader.file(raw)}: key {raw!r} has dtype {array.dtype}; "
                    "expected bfloat16, float16 or float32"
                )
            done.add(key)
            nbytes += array.nbytes
            bar.update()
            return array

        with bar:
            if mesh is None:
                params = model.module.params_from_hf(model.cfg, get, dtype)
            else:
                from dtree_jax.models import sharding
                from dtree_jax.models.layers import deferred_leaf

                deferred = model.module.build_params(model.cfg, deferred_leaf(expected, get, dtype))
                params = sharding.place(deferred, mesh, model.cfg)
    if done != expected.keys():
        unread = sorted(expected.keys() - done)
        raise RuntimeError(f"{model.module.__name__}.params_from_hf did not read {unread}")
    return params, ReadStats(len(done), nbytes, time.perf_counter() - start)


def load_hf(
    path: str | Path, dtype: Any = None, *, progress: bool = True, mesh: Any = None
) -> tuple[str, Any, Any]:
    """Converts an HF model directory in memory: ``(kind, cfg, params)``.

    ``dtype`` (a name or dtype in ``DTYPES``) defaults to the config's ``dtype``/``torch_dtype``, else
    float32.  ``mesh``: each leaf placed into its shards as it is read (``read_params``).
    """
    model = HFModel.open(path)
    params, _ = read_params(model, dtype, progress=progress, mesh=mesh)
    dtype = _dtype(dtype, model.config)
    return model.kind, _config_from_hf(model.module, model.config, model.config_file, dtype), params


# ----------------------------------------------------------------------------------------------------------
# Converted (orbax) directories


def _convert_one(src: Path, dst: Path, role: str, dtype: str, progress: bool) -> tuple[str, ReadStats]:
    model = HFModel.open(src)
    if families.family(model.kind).drafter != (role == "drafter"):
        raise ValueError(f"{model.config_file}: a {model.kind} model cannot be the {role}")
    with jax.default_device(jax.devices("cpu")[0]):  # keep the host copy off accelerators
        params, stats = read_params(model, dtype, progress=progress)
    import orbax.checkpoint as ocp

    dst.mkdir(parents=True)
    if model.gguf is not None:
        model.gguf.write_model_files(dst)
    else:
        extra = (CALIBRATION_FILE,) if role == "drafter" else ()
        for name in ("config.json", *TOKENIZER_FILES, *extra):
            if name == "config.json" or (model.path / name).exists() or (model.path / name).is_symlink():
                shutil.copyfile(checkpoint_files.confined(model.path, name), dst / name)
    # Synchronous (no background writer): an interrupt stops the save in this thread, so the caller's cleanup
    # never races a writer still filling the directory it removes.
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
        ckptr.save(dst / PARAMS_DIR, args=ocp.args.StandardSave(params))
    meta = {"kind": model.kind, "dtype": _dtype(dtype, model.config).name, "source": str(model.path)}
    (dst / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return model.kind, stats


def convert(
    target_dir: str | Path,
    drafter_dir: str | Path | None = None,
    *,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
) -> dict:
    """Converts an HF target directory or GGUF file (and a drafter directory) to ``out_dir/target`` (and
    ``out_dir/drafter``).

    The result is built in a temporary sibling directory and renamed into place, so ``out_dir`` is untouched
    unless the whole conversion succeeds.  An existing non-empty ``out_dir`` is replaced only with
    ``overwrite``; a symlink ``out_dir`` is followed (the conversion lands where it points).  Conversions and
    loads of one ``out_dir`` are serialised by ``destination_lock``: a second conversion waits for the first,
    then finds ``out_dir`` taken.
    Returns a summary: ``{"out", "dtype", "models": {role: kind}, "keys", "bytes", "seconds"}``.
    """
    start = time.perf_counter()
    out = Path(out_dir).absolute()
    out = out.resolve() if out.is_symlink() else out
    dtype = _dtype(dtype, {}).name
    for src in (target_dir, drafter_dir):
        if src is not None and (Path(src).resolve() == out.resolve() or Path(src).resolve().is_relative_to(out.resolve())):
            raise ValueError(f"--out {out} holds the input {src}; converting into it could delete it, choose "
                             "another --out")
    _check_replaceable(out, overwrite)
    with destination_lock(out):
        _check_replaceable(out, overwrite)  # again: another process may have filled it while this one waited
        summary = _convert_into(out, target_dir, drafter_dir, dtype, progress)
    summary["seconds"] = time.perf_counter() - start
    return summary


def _check_replaceable(out: Path, overwrite: bool) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise ValueError(f"{out}: exists and is not an empty directory; pass overwrite=True (--overwrite)")


@contextlib.contextmanager
def destination_lock(out: Path, shared: bool = False):
    """Holds the lock of conversion destination ``out`` (a file under ``cache_dir()/locks`` named by the hash of
    ``out``'s resolved path, so no lock file litters the user's directories): exclusive to write ``out``,
    ``shared`` to read it (a load; only when some conversion ever made that lock), so no process reads a
    directory another is swapping and two conversions into ``out`` never both install.  Waits for the holder,
    saying so on stderr.  Where the cache cannot be written, nothing is locked."""
    name = hashlib.sha256(str(Path(out).absolute().resolve()).encode()).hexdigest()[:32]
    lock = cache_dir() / "locks" / f"{name}.lock"
    try:
        if not shared:
            lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
    except OSError:
        fd = None
    try:
        if fd is not None:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another dtree-jax process {'writing' if shared else 'using'} {out}",
                      file=sys.stderr, flush=True)
                fcntl.flock(fd, mode)
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _convert_into(out: Path, target_dir, drafter_dir, dtype: str, progress: bool) -> dict:
    """The conversion itself, with ``out``'s lock held: built in a temporary sibling, then installed."""
    try:
        _remove_stale_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise ValueError(f"{out}: cannot write there ({e.strerror}); choose another --out") from None
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the result gets the mode any new directory would
    summary = {"out": str(out), "dtype": dtype, "models": {}, "keys": 0, "bytes": 0}
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():  # SIGTERM cleans up like Ctrl-C
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for role, src in (("target", target_dir), ("drafter", drafter_dir)):
            if src is not None:
                kind, stats = _convert_one(Path(src), tmp / role, role, dtype, progress)
                summary["models"][role] = kind
                summary["keys"] += stats.keys
                summary["bytes"] += stats.bytes
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
    return summary


def _install(tmp: Path, out: Path) -> None:
    """Renames the finished ``tmp`` to ``out``; an existing ``out`` is moved aside first, put back if the
    rename fails, and removed once ``tmp`` is in place."""
    if not out.exists():
        tmp.rename(out)
        return
    old = tmp.with_name(tmp.name + ".old")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _remove_stale_partials(out: Path) -> None:
    """Removes ``.<out>.partial-<pid>-*`` directories left by conversions whose process no longer runs (killed
    with SIGKILL, or by a power cut); a live conversion's directory is left alone."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(partial.name[len(f".{out.name}.partial-"):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours to judge: an old name, or another user's process
            continue


def _read_meta(path: Path) -> dict:
    meta = checkpoint_files.read_json(path, META_FILE)
    if not all(isinstance(meta.get(k), str) for k in ("kind", "dtype")):
        raise ValueError(f"{path / META_FILE}: not a converted dtree_jax model (needs string 'kind' and 'dtype')")
    return {"kind": meta["kind"], "dtype": meta["dtype"]}


def load_converted(path: str | Path, shardings: Any = None, mesh: Any = None) -> tuple[str, Any, Any]:
    """Restores a converted model directory (``out/target`` or ``out/drafter``): ``(kind, cfg, params)``.

    ``shardings``: one ``jax.sharding.Sharding`` for every leaf, or a pytree of them matching the params;
    ``mesh``: the ``models.sharding`` table's shardings on that mesh (each device reads only its shards);
    default: the first device.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta = _read_meta(path)
    module = families.module(meta["kind"])
    cfg = _config_from_hf(module, read_config(path), path / "config.json", meta["dtype"])
    abstract = module.abstract_params(cfg, jnp.dtype(meta["dtype"]))
    if mesh is not None:
        from dtree_jax.models import sharding

        shardings = sharding.shardings(abstract, mesh, cfg)
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, abstract)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    with destination_lock(path.parent, shared=True):  # not while a conversion swaps the directory
        params_dir = checkpoint_files.confined_tree(path, PARAMS_DIR)
        with ocp.StandardCheckpointer() as ckptr, _file_errors(params_dir, "restore orbax params"):
            params = ckptr.restore(params_dir, target)
    return meta["kind"], cfg, params


GGUF_CACHE_DTYPE = "float32"  # GGUF weights are dequantised; float32 keeps them exactly


def cache_dir() -> Path:
    """Where GGUF files are converted on the fly: ``$DTREE_JAX_CACHE``, else ``$XDG_CACHE_HOME/dtree-jax``,
    else ``~/.cache/dtree-jax``."""
    if os.environ.get("DTREE_JAX_CACHE"):
        return Path(os.environ["DTREE_JAX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtree-jax"


def _umask() -> int:
    """The process's umask (read by setting it, then restoring it)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def model_dir(path: str | Path, *, progress: bool = True, weights: bool = True) -> Path:
    """The directory to load ``path`` from: ``path`` itself, or for a GGUF file its converted copy in
    ``cache_dir()`` (keyed by the file's resolved path, size and mtime; converted on first use, atomically,
    as float32 and reused afterwards).  ``weights=False``: a GGUF file not converted yet gets only its config
    and tokenizer files written there (``<name>-<key>-files``, atomically), for a load that streams its
    tensors straight into a mesh (``load_model``)."""
    path = Path(path)
    if not is_gguf(path):
        return path
    if not path.is_file():
        raise ValueError(f"{path}: GGUF file not found")
    file = path.resolve()
    st = file.stat()
    key = hashlib.sha256(f"{file}\0{st.st_size}\0{st.st_mtime_ns}\0{GGUF_CACHE_DTYPE}".encode()).hexdigest()
    out = cache_dir() / f"{file.stem}-{key[:16]}"
    if (out / "target" / META_FILE).is_file():
        return out / "target"
    from dtree_jax.gguf import GGUFCheckpoint

    if not weights:  # beside the conversion's directory, which a later conversion replaces whole
        files = out.with_name(out.name + "-files")
        if not (files / "config.json").is_file():
            files.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{files.name}.partial-", dir=files.parent))
            try:
                GGUFCheckpoint(file).write_model_files(tmp)
                tmp.chmod(0o777 & ~_umask())
                tmp.rename(files)
            except OSError:  # another process wrote it first
                if not (files / "config.json").is_file():
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return files
    GGUFCheckpoint(file)  # a bad file is refused before anything is said or written
    with destination_lock(out):
        if not (out / "target" / META_FILE).is_file():  # else another process converted it while this one waited
            print(f"converting {file} to {out} (once; later runs reuse it)", file=sys.stderr)
            _convert_into(out, file, None, GGUF_CACHE_DTYPE, progress)
    return out / "target"


def load_model(path: str | Path, dtype: Any = None, mesh: Any = None) -> tuple[str, Any, Any]:
    """``(kind, cfg, params)`` from a converted model directory, an HF directory (converted in memory) or a
    GGUF file (converted once into the cache, see ``model_dir``).

    ``dtype`` None keeps the converted dtype (HF: the config's dtype); otherwise leaves are cast to it.
    ``mesh`` (a ``jax.sharding.Mesh``): params placed with the ``models.sharding`` table's shardings; a converted
    directory is restored straight into its shards, an HF directory is read one tensor at a time and each leaf
    placed into its shards at once (the host holds one leaf, never the model), and so is a GGUF file not yet
    converted into the cache (its tensors dequantised one at a time; once converted, the cache is restored).
    """
    if mesh is not None and is_gguf(path) and not (model_dir(path, weights=False) / META_FILE).is_file():
        return load_hf(path, dtype or GGUF_CACHE_DTYPE, mesh=mesh)
    path = model_dir(path)
    if (path / META_FILE).is_file():
        kind, cfg, params = load_converted(path, mesh=mesh)
        if dtype is not None:
            module = families.module(kind)
            abstract = module.abstract_params(cfg, _dtype(dtype, {}))
            params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, abstract)
            cfg = _config_from_hf(module, read_config(path), path / "config.json", _dtype(dtype, {}))
        return kind, cfg, params
    if (path / "config.json").is_file():
        return load_hf(path, dtype, mesh=mesh)
    roles = [r for r in ("target", "drafter") if (path / r / META_FILE).is_file()]
    if roles:
        raise ValueError(f"{path}: a conversion output; pass {' or '.join(str(path / r) for r in roles)}")
    raise ValueError(
        f"{path}: neither a converted model ({META_FILE}), an HF model directory (config.json) nor a .gguf file"
    )


def abstract_model(path: str | Path, dtype: Any = None) -> tuple[str, Any, Any]:
    """``(kind, cfg, params of jax.ShapeDtypeStruct)`` from a model's config alone, no weight read: a
    ``config.json`` file, an HF or converted model directory, or a GGUF file (its metadata).  ``dtype`` None:
    the converted dtype, else the config's ``dtype`` / ``torch_dtype`` (float32 when it names none).  For
    compiling ahead of time (``dtree_jax.aot``)."""
    path = Path(path)
    if path.suffix == ".json" and path.is_file():
        config_file = path
    elif path.is_file() and not is_gguf(path):
        raise ValueError(f"{path}: expected a config.json file, a model directory or a .gguf file")
    else:
        path = model_dir(path, weights=False)  # a GGUF file: its config, written from the metadata
        config_file = path / "config.json"
        if dtype is None and (path / META_FILE).is_file():
            dtype = _read_meta(path)["dtype"]
    config = read_config(config_file if config_file.is_file() else path)
    kind = model_kind(config, config_file)
    module = families.module(kind)
    resolved = _dtype(dtype, config)
    cfg = _config_from_hf(module, config, config_file, resolved)
    return kind, cfg, module.abstract_params(cfg, resolved)


# ----------------------------------------------------------------------------------------------------------
# CLI


def _run_cli(args) -> int:
    s = convert(
        args.target,
        args.drafter,
        out_dir=args.out,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    models = " + ".join(role if kind == role else f"{role} ({kind})" for role, kind in s["models"].items())
    print(
        f"converted {models} to {s['out']} as {s['dtype']}: {s['keys']} keys, "
        f"{s['bytes'] / 1e9:.3f} GB read, {s['seconds']:.1f} s"
    )
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert HF/PyTorch/GGUF target (and drafter) checkpoints to dtree_jax (orbax)"
    )
    p.add_argument("--target", required=True, help="HF target model directory (config.json + weights) or GGUF file")
    p.add_argument("--drafter", help="HF DFlash/Domino drafter directory")
    p.add_argument("--out", required=True, help="output directory (gets target/ and drafter/)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of the converted params (default: bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_cli)
