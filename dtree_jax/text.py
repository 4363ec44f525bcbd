"""Text in and out of a model directory: its tokenizer (``tokenizer.json``) and its chat template
(``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``), rendered with jinja2 the way
transformers' ``apply_chat_template`` does (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Sequence


def load_tokenizer(path: str | Path | None):
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json``, or None when there is none."""
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def tokenizer_config(path: str | Path) -> dict:
    file = Path(path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from e


def chat_template(path: str | Path) -> str:
    """The checkpoint's chat template (a list of named templates: the one named ``default``)."""
    template = tokenizer_config(path).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (Path(path) / "chat_template.jinja").is_file():
        template = (Path(path) / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        raise ValueError(
            f"{path}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
        )
    return template


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    from datetime import datetime

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_chat(
    path: str | Path, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    """``messages`` (``[{"role": ..., "content": ...}]``) rendered with ``path``'s chat template."""
    config = tokenizer_config(path)
    specials = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(name)
        specials[name] = token.get("content") if isinstance(token, dict) else token
    return _compiled(chat_template(path)).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **specials
    )


def encode_prompts(path: str | Path | None, texts: Sequence[str], *, chat: bool = False) -> list[list[int]]:
    """Token ids of text prompts with ``path``'s tokenizer; ``chat``: each text is one user message, rendered
    with the chat template first (then encoded without adding BOS/EOS: the template writes them)."""
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(
            f"{path}: text prompts need a tokenizer.json in the target checkpoint; pass token ids"
        )
    if chat:
        rendered = [render_chat(path, [{"role": "user", "content": t}]) for t in texts]
        return [tokenizer.encode(r, add_special_tokens=False).ids for r in rendered]
    return [tokenizer.encode(t).ids for t in texts]
