"""Text in and out of a model directory: its tokenizer (``tokenizer.json``), its chat template
(``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``, rendered by ``template_sandbox``: a
template is untrusted code) and the encoding of prompts, which refuses a prompt the tokenizer cannot spell
instead of silently dropping characters.  Every file is read through ``checkpoint_files``; every error names
its file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from dtree_jax import checkpoint_files, template_sandbox


def load_tokenizer(path: str | Path | None):
    """The ``tokenizers.Tokenizer`` of ``path/tokenizer.json`` (read through ``checkpoint_files``), or None when
    there is none; a ValueError naming the file when the tokenizers library cannot build it."""
    if path is None or not checkpoint_files.present(path, "tokenizer.json"):
        return None
    from tokenizers import Tokenizer

    data = checkpoint_files.read_text(path, "tokenizer.json", checkpoint_files.TOKENIZER_LIMIT)
    try:
        return Tokenizer.from_str(data)
    except Exception as e:  # the library raises a bare Exception for every malformed file
        raise ValueError(f"{Path(path) / 'tokenizer.json'}: not a tokenizer the tokenizers library can read "
                         f"({str(e)[:200]})") from None


def tokenizer_config(path: str | Path) -> dict:
    """``path/tokenizer_config.json`` (read through ``checkpoint_files``), or {} when there is none."""
    if not checkpoint_files.present(path, "tokenizer_config.json"):
        return {}
    return checkpoint_files.read_json(path, "tokenizer_config.json")


def chat_template(path: str | Path) -> tuple[str, str]:
    """``(template, source)``: the checkpoint's chat template (``tokenizer_config.json``'s ``chat_template``, a
    string or a list of ``{name, template}`` of which ``default``; else ``chat_template.jinja``) and where it
    was read, for messages; a ValueError naming it when it is missing, mistyped or longer than
    ``template_sandbox.TEMPLATE_SOURCE``."""
    template = tokenizer_config(path).get("chat_template")
    source = f"{Path(path) / 'tokenizer_config.json'} chat_template"
    if isinstance(template, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise ValueError(f"{source}: a list of templates must hold objects with a string 'name'")
        template = next((t.get("template") for t in template if t["name"] == "default"), None)
    if template is None and checkpoint_files.present(path, "chat_template.jinja"):
        template = checkpoint_files.read_text(path, "chat_template.jinja")
        source = str(Path(path) / "chat_template.jinja")
    if template is None:
        raise ValueError(
            f"{path}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
        )
    if not isinstance(template, str):
        raise ValueError(f"{source}: must be a string (or a list of {{name, template}} objects), got "
                         f"{type(template).__name__}")
    if len(template) > template_sandbox.TEMPLATE_SOURCE:
        raise ValueError(f"{source}: {len(template)} characters, more than {template_sandbox.TEMPLATE_SOURCE}; refusing to compile it")
    return template, source


def special_tokens(path: str | Path) -> dict[str, str | None]:
    """``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token`` from ``tokenizer_config.json`` as a template
    sees them: each a string, an object with a string ``content`` (transformers' AddedToken) or absent; a
    ValueError naming the field otherwise."""
    config, tokens = tokenizer_config(path), {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and not isinstance(token, str):
            raise ValueError(f"{Path(path) / 'tokenizer_config.json'}: {name} must be a string or an object with a "
                             f"string 'content', got {config[name]!r:.100}")
        tokens[name] = token
    return tokens


def render_chat(
    path: str | Path, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    """``messages`` (``[{"role": ..., "content": ...}]``) rendered with ``path``'s chat template within the
    limits above; anything that goes wrong in the template (a limit, a syntax error, an undefined name, its own
    ``raise_exception``, a type error, recursion...) is a ValueError naming its source."""
    template, source = chat_template(path)
    context = dict(messages=list(messages), add_generation_prompt=add_generation_prompt, **special_tokens(path))
    try:
        return template_sandbox.render(template, context)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from e.__cause__


def encode_checked(tokenizer, text: str, source: str | Path, add_special_tokens: bool = True) -> list[int]:
    """The token ids of ``text``; a ValueError naming ``source`` (the tokenizer's file) when the encoding covers
    not every character but whitespace (by its tokens' offsets): one the vocabulary cannot spell and that no
    unknown token stands for would otherwise vanish from the prompt."""
    encoding = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    covered = 0
    for start, end in [*sorted(encoding.offsets), (len(text), len(text))]:
        gap = text[covered:start]
        if gap.strip():
            at = covered + len(gap) - len(gap.lstrip())
            raise ValueError(f"{source}: cannot encode {text[at]!r} (U+{ord(text[at]):04X}, character {at} of "
                             f"{text[max(0, at - 30):at + 30]!r}): the tokenizer has no token for it and no unknown "
                             "token, and would drop it")
        covered = max(covered, end)
    return encoding.ids


def encode_prompts(path: str | Path | None, texts: Sequence[str], *, chat: bool = False) -> list[list[int]]:
    """Token ids of text prompts with ``path``'s tokenizer (``encode_checked``); ``chat``: each text is one user
    message, rendered with the chat template first (then encoded without adding BOS/EOS: the template writes
    them)."""
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(
            f"{path}: text prompts need a tokenizer.json in the target checkpoint; pass token ids"
        )
    source = Path(path) / "tokenizer.json"
    if chat:
        rendered = [render_chat(path, [{"role": "user", "content": t}]) for t in texts]
        return [encode_checked(tokenizer, r, source, add_special_tokens=False) for r in rendered]
    return [encode_checked(tokenizer, t, source) for t in texts]
