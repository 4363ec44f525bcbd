"""Hostile checkpoints against ``dtree_jax.text`` (issue 28): chat templates that would run for ever, fill memory
or fail in odd ways, and vocabularies that cannot spell their prompts.  Each probe must come back within 10 s as
one ValueError naming the file; each control shows the attack is real (jinja2's plain sandbox does make the big
output, keeps running, or raises a raw exception; the tokenizers library does drop the character), so a guard
that stopped working fails here.  Real templates still render exactly as transformers renders them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, models, pre_tokenizers

from dtree_jax import template_sandbox, text
from dtree_jax.cli import main, shipped

HANG = 10.0  # seconds: a probe slower than this is the defect itself
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
EXPONENTIAL_MACRO = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
USER = [{"role": "user", "content": "hi there"}]


def _checkpoint(root, template: str | None = None, config: dict | None = None, vocab: str | None = None,
                unk: bool = False):
    """A checkpoint directory: ``chat_template.jinja``, ``tokenizer_config.json``, and a character-level BPE
    ``tokenizer.json`` spelling ``vocab`` (plus ``<unk>`` as its unknown token if ``unk``)."""
    root.mkdir(parents=True, exist_ok=True)
    if template is not None:
        (root / "chat_template.jinja").write_text(template)
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config))
    if vocab is not None:
        ids = {c: i for i, c in enumerate(dict.fromkeys(vocab))}
        if unk:
            ids["<unk>"] = len(ids)
        tokenizer = Tokenizer(models.BPE(vocab=ids, merges=[], unk_token="<unk>" if unk else None))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        (root / "tokenizer.json").write_text(tokenizer.to_str())
    return root


def _raise(message):
    raise TemplateError(message)


def _plain(template: str) -> str:
    """``template`` rendered by jinja2's sandbox as transformers sets it up, without our limits."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    env.globals["raise_exception"] = _raise
    return env.from_string(template).render(messages=USER)


def _refused(path, *match: str) -> None:
    """Checks that ``render_chat`` refuses ``path``'s template within ``HANG`` seconds with a one-line ValueError
    naming the template's file and each of ``match``."""
    start = time.monotonic()
    with pytest.raises(ValueError) as caught:
        text.render_chat(path, USER)
    seconds, message = time.monotonic() - start, str(caught.value)
    assert seconds < HANG, (seconds, message)
    assert message.startswith(str(path / "chat_template.jinja") + ": ") and "\n" not in message, message
    assert all(m in message for m in match), message


# (name, template with NUM for its size, the hostile size, a small size, the small output's length, the refusal)
SIZE_PROBES = [
    ("lipsum", "{{ lipsum(NUM) }}", 10**6, 2, None, "'lipsum' is undefined"),
    ("power", "{{ 10 ** NUM }}", 10**10, 100, 101, "'**' would make an integer"),
    ("repeat", "{{ 'a' * 7 * NUM }}", 10**9, 100, 700, "'*' would make the template create more"),
    ("tojson indent", "{{ messages | tojson(indent=NUM) }}", 10**9, 12, 117, "the filter tojson was given"),
    ("tojson indent in range", "{{ messages | tojson(indent=NUM) }}", 1000, 12, 117, "tojson indent 1000 is wider"),
    ("strftime", "{{ strftime_now('%Y' * NUM) }}", 10**8, 10, 40, "'*' would make the template create more"),
    ("strftime in range", "{{ strftime_now('%Y' * NUM) }}", 10**5, 10, 40, "strftime_now's format is 200000"),
    ("ljust", "{{ 'a'.ljust(NUM) }}", 10**9, 50, 50, "ljust() was given 1000000000"),
    ("center", "{{ 'a' | center(NUM) }}", 10**9, 50, 50, "the filter center was given 1000000000"),
    ("doubling ~", "{% set ns = namespace(s='ab') %}{% for i in range(NUM) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s }}", 60, 10, 2048, "'~' would make the template create more"),
    ("doubling +", "{% set ns = namespace(s='ab') %}{% for i in range(NUM) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}{{ ns.s }}", 60, 10, 2048, "'+' would make the template create more"),
    ("squaring", "{% set ns = namespace(x=3) %}{% for i in range(NUM) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
     "{{ ns.x }}", 40, 6, 31, "'*' would make an integer"),
    ("% star width", "{{ '%*d' % (NUM, 1) }}", 10**9, 30, 30, "'%' would make the template create more"),
    ("% width", "{{ '%NUMd' % 1 }}", 10**9, 30, 30, "'%' would make the template create more"),
    ("format width", "{{ '{:>NUM}'.format(1) }}", 10**9, 30, 30, "format() would make the template create more"),
    ("format filter width", "{{ '%NUMs' | format('x') }}", 10**9, 30, 30, "the filter format would make"),
    ("replace", "{{ ('x' * 1000) | replace('', 'y' * NUM) }}", 10**5, 3, 4003, "the filter replace would make"),
    ("join", "{{ ('y' * NUM).join('x' * 100000) }}", 10**5, 1, 199999, "join() would make the template create"),
    ("indent", "{{ ('a\n' * 100000) | indent(NUM) }}", 10**6, 2, 399998, "the filter indent would make"),
    ("macro doubling", "{% macro f(n) %}{% if n %}{% set x = f(n - 1) %}{{ x }}{{ x }}{% else %}ab{% endif %}"
     "{% endmacro %}{{ f(NUM) }}", 60, 10, 2048, "writes more than 4,194,304 characters"),
    ("shared lists", "{% set ns = namespace(l=[1]) %}{% for i in range(NUM) %}{% set ns.l = [ns.l, ns.l] %}"
     "{% endfor %}{{ ns.l }}", 100, 4, 108, "a list would make the template create more"),
    ("slices kept", "{% set a = 'x' * NUM %}" + "".join(f"{{% set b{i} = a[::-1] %}}" for i in range(10)) +
     "{{ b9 }}", 10**7, 5, 5, "a slice would make the template create more"),
    ("output", "{% for i in range(NUM) %}{{ 'x' * 1000 }}{% endfor %}", 100000, 3, 3000, "writes more than"),
]


@pytest.mark.parametrize("probe", SIZE_PROBES, ids=[p[0] for p in SIZE_PROBES])
def test_a_template_that_would_make_something_huge_is_refused_at_once(tmp_path, probe):
    _, template, huge, _, _, message = probe
    _refused(_checkpoint(tmp_path, template.replace("NUM", str(huge))), message)


@pytest.mark.parametrize("probe", SIZE_PROBES, ids=[p[0] for p in SIZE_PROBES])
def test_the_same_construct_at_a_small_size_renders_as_the_plain_sandbox_does(tmp_path, probe):
    """The control: at a small size the construct does make what its size says (so at the hostile size it would
    make that much), in jinja2's plain sandbox and with our limits alike."""
    name, template, _, small, length, _ = probe
    small_template = template.replace("NUM", str(small))
    if name == "lipsum":  # removed from ours; the plain sandbox writes paragraphs of it
        assert len(_plain(small_template)) > 100
        return
    ours = text.render_chat(_checkpoint(tmp_path, small_template), USER)
    assert len(_plain(small_template)) == len(ours) == length
    if name not in ("strftime", "strftime in range"):
        assert ours == _plain(small_template)


@pytest.mark.parametrize("template", [NESTED_LOOPS, EXPONENTIAL_MACRO], ids=["nested loops", "exponential macro"])
def test_a_template_that_would_run_for_ever_is_stopped_at_the_deadline(tmp_path, monkeypatch, template):
    monkeypatch.setattr(template_sandbox, "TEMPLATE_SECONDS", 1.0)
    start = time.monotonic()
    _refused(_checkpoint(tmp_path, template), "took longer than 1 s")
    assert 1.0 <= time.monotonic() - start < 3.0
    with pytest.raises(subprocess.TimeoutExpired):  # the control: the plain sandbox is still at it after 2 s
        subprocess.run([sys.executable, "-c", "from jinja2.sandbox import ImmutableSandboxedEnvironment as E; "
                        f"E().from_string({template!r}).render()"], timeout=2, capture_output=True)


def test_the_deadline_holds_at_its_default_on_a_real_template_with_loops_put_in(tmp_path):
    """SmolLM2's own template (from the shipped GGUF) with nested loops put before its messages."""
    from dtree_jax.gguf import GGUFCheckpoint, smollm2_gguf

    real = GGUFCheckpoint(smollm2_gguf()).tokenizer_config()["chat_template"]
    assert real.startswith("{% for message in messages %}")
    start = time.monotonic()
    _refused(_checkpoint(tmp_path, NESTED_LOOPS + real), f"took longer than {template_sandbox.TEMPLATE_SECONDS:g} s")
    assert time.monotonic() - start >= template_sandbox.TEMPLATE_SECONDS


def test_the_deadline_holds_outside_the_main_thread_and_the_trace_function_comes_back(tmp_path, monkeypatch):
    monkeypatch.setattr(template_sandbox, "TEMPLATE_SECONDS", 0.5)
    path, seen = _checkpoint(tmp_path, NESTED_LOOPS), []

    def tracer(frame, event, arg):
        return None

    def render():
        sys.settrace(tracer)
        try:
            text.render_chat(path, USER)
        except ValueError as e:
            seen.append((str(e), sys.gettrace() is tracer))
        sys.settrace(None)

    worker = threading.Thread(target=render)
    worker.start()
    worker.join(HANG)
    assert not worker.is_alive() and seen == [(f"{path / 'chat_template.jinja'}: took longer than 0.5 s to render",
                                               True)]
    before = sys.gettrace()
    (path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert text.render_chat(path, USER) == "hi there" and sys.gettrace() is before


ERRORS = [
    ("undefined", "{{ nothing.here }}", "UndefinedError: 'nothing' is undefined", "UndefinedError"),
    ("unsafe", "{{ messages.append(1) }}", "SecurityError: access to attribute 'append'", "SecurityError"),
    ("raise_exception", "{{ raise_exception('Roles must alternate') }}",
     "the template refused the conversation: Roles must alternate", "TemplateError"),
    ("syntax", "{% if %}", "syntax error on line 1", "TemplateSyntaxError"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep", "RecursionError"),
    ("type", "{{ 1 + 'a' }}", "TypeError: unsupported operand", "TypeError"),
    ("zero", "{{ 1 // 0 }}", "ZeroDivisionError", "ZeroDivisionError"),
    ("nested blocks", "{% for x in [1] %}" * 30 + "{% endfor %}" * 30, "SyntaxError: too many statically nested",
     "SyntaxError"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[e[0] for e in ERRORS])
def test_every_template_error_is_one_value_error_naming_the_file(tmp_path, case):
    _, template, message, raw = case
    _refused(_checkpoint(tmp_path, template), message)
    with pytest.raises(BaseException) as plain:  # the control: jinja2 alone raises it raw
        _plain(template)
    assert type(plain.value).__name__ == raw and not isinstance(plain.value, ValueError)


def test_a_template_in_tokenizer_config_is_named_by_its_field(tmp_path):
    path = _checkpoint(tmp_path, config={"chat_template": "{{ 'a' * 10 ** 10 }}"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json chat_template: '\*' would make the template"):
        text.render_chat(path, USER)


@pytest.mark.parametrize("config, message", [
    ({"chat_template": "x", "bos_token": 5}, "bos_token must be a string"),
    ({"chat_template": "x", "eos_token": {"content": ["</s>"]}}, "eos_token must be a string"),
    ({"chat_template": 5}, "tokenizer_config.json chat_template: must be a string"),
    ({"chat_template": [1]}, "chat_template: a list of templates must hold objects"),
    ({"chat_template": [{"name": "default", "template": 3}]}, "chat_template: must be a string"),
    ({"chat_template": "x" * (template_sandbox.TEMPLATE_SOURCE + 1)}, "refusing to compile it"),
])
def test_mistyped_tokenizer_config_fields_are_named(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        text.render_chat(_checkpoint(tmp_path, config=config), USER)


REAL_LOOKING = {
    "qwen-like": """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = messages|length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages if message.role != 'system' %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- for call in message.tool_calls or [] %}{{ '<tool_call>' ~ call | tojson ~ '</tool_call>' }}{% endfor %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}""",
    "llama-like": """{{- bos_token }}{%- set date = strftime_now("%d %b %Y") %}{{ "Today Date: " + date + "\\n" }}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'assistant' %}
        {{- raise_exception('Conversations start with the user') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
    {{- {"n": loop.index, "first": (loop.first, loop.last), "x": [1, 2.5, none]} | tojson(indent=4) }}
    {{- "%s:%03d|%-6s|" % (message.role, loop.index, 'x') }}{{ "{:>8}".format(message.role) }}
    {{- message.content | replace('a', 'A') | center(30) | indent(2) }}{{ message.content.split(' ') | join('_') }}
    {{- messages | map(attribute='role') | join(',') }}
    {{- (messages | selectattr('role', 'equalto', 'user') | list | length) * 3 }}
    {{- 2 ** 10 }}{{ 'ab' * 3 }}{{ [1, 2] + [3] }}{{ eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}""",
}
CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a question"},
     {"role": "assistant", "content": "<think>hmm</think>\nan answer", "tool_calls": [{"name": "f", "arguments": {}}]},
     {"role": "user", "content": "again? " * 3}],
    [{"role": "user", "content": "a long one " * 50_000}],
]


def test_real_templates_render_exactly_as_transformers_renders_them(tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    from dtree_jax.gguf import GGUFCheckpoint, smollm2_gguf

    smollm2 = GGUFCheckpoint(smollm2_gguf()).tokenizer_config()
    templates = {"smollm2": smollm2["chat_template"], **REAL_LOOKING}
    tokens = {"bos_token": smollm2["bos_token"], "eos_token": smollm2["eos_token"]}
    for name, template in templates.items():
        path = _checkpoint(tmp_path / name, config={"chat_template": template, **tokens})
        for messages in CONVERSATIONS:
            want = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                         unk_token=None, pad_token=None, **tokens)[0][0]
            assert text.render_chat(path, messages) == want, name


def test_a_vocabulary_that_cannot_spell_the_prompt_is_refused(tmp_path):
    path = _checkpoint(tmp_path, "{{ messages[0].content }}!", vocab="hter")
    raw = Tokenizer.from_file(str(path / "tokenizer.json")).encode("hi there")
    assert raw.tokens == ["h", "t", "h", "e", "r", "e"]  # the control: the library drops the 'i' silently
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot encode 'i' \(U\+0069, character 1 of 'hi there'"):
        text.encode_prompts(path, ["hi there"])
    with pytest.raises(ValueError, match=r"tokenizer\.json: cannot encode '!' \(U\+0021, character 7 of"):
        text.encode_prompts(path, ["the  re"], chat=True)
    assert text.encode_prompts(path, ["the  re \n", "   "]) == [[1, 0, 2, 3, 2], []]  # whitespace is not text


def test_an_unknown_token_covers_what_the_vocabulary_cannot_spell(tmp_path):
    path = _checkpoint(tmp_path, vocab="hter", unk=True)
    assert text.encode_prompts(path, ["hi there"]) == [[0, 4, 1, 0, 2, 3, 2]]


def test_the_command_line_gives_one_line_for_a_hostile_template(tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(shipped("tiny-target"), target)
    (target / "chat_template.jinja").write_text("{{ 'a' * 7 * 10 ** 9 }}")
    start = time.monotonic()
    assert main(["generate", "--target", str(target), "--method", "ar", "--chat", "--prompt", "hi"]) == 2
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert err.startswith(f"dtree-jax: error: {target / 'chat_template.jinja'}: '*' would make the template") and \
        len(err.strip().splitlines()) == 1, err
