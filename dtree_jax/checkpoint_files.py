"""Files read out of a checkpoint the user named, by every command: each one resolved inside that directory
(symlinks followed, none leading out), a regular file (no FIFO, device or directory) and no larger than its cap,
so a crafted checkpoint can neither make us read outside it nor hang or fill memory while we read it.  Every
refusal is a ``ValueError`` naming the file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MIB = 2**20
JSON_LIMIT = 64 * MIB  # config.json, tokenizer_config.json, generation_config.json, an index, calibration.json
TEXT_LIMIT = 4 * MIB  # a chat template file
TOKENIZER_LIMIT = 128 * MIB  # tokenizer.json (the largest real ones are ~35 MB)


def _inside(root: str | Path, path: Path) -> Path:
    """``path`` resolved; a ValueError when that leads out of ``root``."""
    resolved = path.resolve()
    if not resolved.is_relative_to(Path(root).resolve()):
        raise ValueError(f"{path}: leads outside the checkpoint directory {root} (to {resolved}); refusing to read it")
    return resolved


def confined(root: str | Path, name: str | Path) -> Path:
    """``root / name`` if it is a regular file inside ``root`` once symlinks are resolved; a ValueError otherwise
    (a path leading out of the checkpoint, a FIFO or device, a directory, nothing there)."""
    file = Path(root) / name
    resolved = _inside(root, file)
    if not resolved.exists():
        raise ValueError(f"{file}: not found")
    if not stat.S_ISREG(resolved.stat().st_mode):
        raise ValueError(f"{file}: not a regular file; refusing to read it")
    return file


def present(root: str | Path, name: str | Path) -> bool:
    """Whether ``root / name`` is there at all: a file, a directory or a symlink (dangling or leading out), so a
    bad link is refused by ``confined`` instead of being taken for a missing optional file."""
    file = Path(root) / name
    return file.exists() or file.is_symlink()


def read_bytes(root: str | Path, name: str | Path, limit: int) -> bytes:
    """The bytes of ``confined(root, name)``; a ValueError when it holds more than ``limit``."""
    file = confined(root, name)
    with open(file, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{file}: larger than {limit / MIB:g} MiB; refusing to read it")
    return data


def read_text(root: str | Path, name: str | Path, limit: int = TEXT_LIMIT) -> str:
    """``read_bytes`` as UTF-8 text; a ValueError naming the file when it is not UTF-8."""
    data = read_bytes(root, name, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{Path(root) / name}: not UTF-8 text ({e})") from None


def read_json(root: str | Path, name: str | Path, limit: int = JSON_LIMIT, expect: type = dict) -> Any:
    """The parsed JSON of ``confined(root, name)``, of type ``expect``; a ValueError naming the file otherwise
    (invalid, nested too deep, another type)."""
    text = read_text(root, name, limit)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{Path(root) / name}: invalid JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{Path(root) / name}: invalid JSON (nested too deep)") from None
    if not isinstance(value, expect):
        raise ValueError(f"{Path(root) / name}: expected a JSON {_JSON_TYPES.get(expect, expect.__name__)}, got "
                         f"{_JSON_TYPES.get(type(value), type(value).__name__)}")
    return value


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def confined_tree(root: str | Path, name: str | Path) -> Path:
    """``root / name`` if it is a directory inside ``root`` and nothing under it (files, subdirectories) leads
    out of ``root`` or is anything but a regular file or directory; a ValueError otherwise."""
    top = Path(root) / name
    _inside(root, top)
    if not top.is_dir():
        raise ValueError(f"{top}: not found (expected a directory)")
    for folder, dirs, files in os.walk(top, followlinks=False):
        for entry in (*dirs, *files):
            path = Path(folder) / entry
            resolved = _inside(root, path)
            mode = os.stat(path).st_mode if resolved.exists() else 0
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ValueError(f"{path}: not a regular file; refusing to read it")
    return top
