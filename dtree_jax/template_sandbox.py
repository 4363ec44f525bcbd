"""Chat templates are untrusted code: a checkpoint's template rendered in jinja2's immutable sandbox, as
transformers' ``apply_chat_template`` renders it (``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``), within limits: ``TEMPLATE_SECONDS`` of wall time to compile and
render (a trace hook checks the clock at every call and line of Python the render runs), at most
``TEMPLATE_OUTPUT`` characters written, and at most ``TEMPLATE_CREATED`` characters created by its operations in
all (an item of a list, tuple or dict counting ``ITEM``).  Every operation that could make something huge (``*``,
``**``, ``+``, ``%``, calls, filters, slices, literals, ``~``) is sized before it runs or charged as it runs,
integers stay under ``TEMPLATE_INT_BITS`` bits, and ``lipsum`` is gone.  ``render`` turns whatever goes wrong
into one ValueError."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import string
import sys
import time
from datetime import datetime
from typing import Any, Callable, Sequence

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MIB = 2**20

TEMPLATE_SECONDS = 5.0  # to compile and render one conversation (real templates: milliseconds)
TEMPLATE_SOURCE = 256 * 1024  # characters of template source (real ones: under 20 K)
TEMPLATE_OUTPUT = 4 * MIB  # characters written (~1M tokens: past any model's context); also the
#                                             largest integer a call or filter may be given
TEMPLATE_CREATED = 64 * MIB  # characters all its operations may create (real: a few times the output)
TEMPLATE_INT_BITS = 1 << 16  # the largest integer ``*`` and ``**`` may make
TOJSON_INDENT = 16  # the widest ``tojson`` indent (real templates: 2 or 4)
STRFTIME_FORMAT = 256  # the longest ``strftime_now`` format
ITEM = 32  # what an item of a list, tuple or dict counts as, in characters (about its memory in bytes)



# ----------------------------------------------------------------------------------------------------------
# The limits of one compile-and-render
# ----------------------------------------------------------------------------------------------------------


class _Refused(BaseException):
    """A template past one of the limits (a BaseException: no ``except Exception`` on the way out of jinja's
    code may swallow it and let the template run on)."""


class _Raised(TemplateError):
    """The template's own ``raise_exception``."""


@dataclasses.dataclass
class _Budget:
    """One compile-and-render's deadline (``time.monotonic``), the characters its operations created, and the
    sizes of the containers charged so far (by id, each held so that its id is not reused; the sandbox is
    immutable, so a container keeps its size while the render runs)."""

    deadline: float
    created: int = 0
    sizes: dict = dataclasses.field(default_factory=dict)  # id -> (container, size)


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("dtree_jax_template_budget")


def _limited(run: Callable[[], Any]) -> Any:
    """``run()`` under a fresh budget, a trace hook in this thread checking the clock at every call of Python
    and every line but this module's until it returns; the trace function there was before is restored."""
    budget = _Budget(time.monotonic() + TEMPLATE_SECONDS)

    def check_clock(frame, event, arg):
        if time.monotonic() > budget.deadline:
            raise _Refused(f"took longer than {TEMPLATE_SECONDS:g} s to render")
        return None if frame.f_code.co_filename == __file__ else check_clock  # the guards' own loops are bounded

    token, previous = _BUDGET.set(budget), sys.gettrace()
    sys.settrace(check_clock)
    try:
        return run()
    finally:
        sys.settrace(previous)
        _BUDGET.reset(token)


def _afford(count: int, what: str) -> None:
    """Refuses ``what`` when it could create ``count`` characters, more than the budget has left."""
    if _BUDGET.get().created + count > TEMPLATE_CREATED:
        raise _Refused(f"{what} would make the template create more than {TEMPLATE_CREATED:,} characters")


def _charge(count: int, what: str) -> None:
    """``what`` created ``count`` characters (or is about to): charged, or refused past the budget."""
    _afford(count, what)
    _BUDGET.get().created += count


_CONTAINERS = (list, tuple, set, frozenset, dict)


def _size(value: Any, limit: int = TEMPLATE_CREATED) -> int:
    """The characters ``value`` takes as text, near enough: a string its length, a list, tuple, set or dict
    ``ITEM`` per item plus its items' (nested, a shared one each time it appears), anything else ``ITEM``;
    counted to just past ``limit`` (so in at most ``limit / ITEM`` steps), a container already charged in this
    render in one step."""
    budget = _BUDGET.get(None)
    known = budget.sizes if budget is not None else {}
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif id(item) in known:
            total += known[id(item)][1]
        elif isinstance(item, dict):
            total += ITEM * len(item)
            pending += item.keys()
            pending += item.values()
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += ITEM * len(item)
            pending += item
        else:
            total += ITEM
    return total


def _charged(value: Any, what: str) -> Any:
    """``value``, its size charged (and, for a container, remembered for the rest of the render)."""
    size = _size(value)
    _charge(size, what)
    if isinstance(value, _CONTAINERS):
        _BUDGET.get().sizes[id(value)] = (value, size)
    return value


_SEQUENCES = (str, bytes, list, tuple)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?([-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?)")


def _format_widths(fmt: str | bytes, values: Sequence, braces: bool) -> int:
    """The widths and precisions ``fmt`` asks for in all (``str.format``'s fields if ``braces``, else ``%``
    conversions); a ``*`` or a nested field counts as the largest integer among ``values``."""
    fmt = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    specs = [s for _, _, s, _ in string.Formatter().parse(fmt) if s] if braces else _PERCENT_SPEC.findall(fmt)
    largest = max((abs(v) for v in values if isinstance(v, int)), default=0)
    return sum(sum(map(int, re.findall(r"\d+", s))) + (largest if re.search(r"[*{]", s) else 0) for s in specs)


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The characters ``left <operator> right`` (``*``, ``**``, ``+`` or ``%``) would create, found before it
    runs; a _Refused for an integer result past ``TEMPLATE_INT_BITS`` bits."""
    if isinstance(left, int) and isinstance(right, int):
        bits = 0
        if operator == "**" and abs(left) > 1 and right > 0:
            bits = right * abs(left).bit_length()
        elif operator == "*":
            bits = left.bit_length() + right.bit_length()
        if bits > TEMPLATE_INT_BITS:
            raise _Refused(f"'{operator}' would make an integer of {bits} bits, more than {TEMPLATE_INT_BITS:,}")
        return 0
    if operator == "*":
        count, items = (right, left) if isinstance(right, int) else (left, right)
        return _size(items) * count if isinstance(count, int) and count > 0 and isinstance(items, _SEQUENCES) else 0
    if operator == "+" and isinstance(left, _SEQUENCES):
        return _size(left) + _size(right)
    if operator == "%" and isinstance(left, (str, bytes)):
        values = right if isinstance(right, tuple) else (right,)
        return len(left) + _size(right) + _format_widths(left, values, braces=False)
    return 0


# calls whose argument (a separator, replacement, indent or fill) may be repeated along their text or list
_REPEATING = frozenset({"replace", "join", "translate", "wordwrap", "indent", "expandtabs", "tojson", "batch",
                        "slice"})


def _check_call(what: str, name: str, receiver: Any, args: Sequence, kwargs: dict, widths: int = 0) -> None:
    """Refuses a call or filter ``name`` (``what`` in messages) given an integer past ``TEMPLATE_OUTPUT``, or that
    could create more than the budget has left: at most its receiver's and arguments' sizes and ``widths`` (what
    its format asks for) in all, or for a ``_REPEATING`` name (1 + the receiver's) x (1 + the largest argument's,
    integers included)."""
    values = (*args, *kwargs.values())
    ints = [abs(v) for v in values if isinstance(v, int)]
    if max(ints, default=0) > TEMPLATE_OUTPUT:
        raise _Refused(f"{what} was given {max(ints)}, more than {TEMPLATE_OUTPUT:,}")
    sizes = [_size(v) for v in values if not isinstance(v, int)]
    if name in _REPEATING:
        estimate = (1 + _size(receiver)) * (1 + max(sizes + ints, default=0))
    else:
        estimate = _size(receiver) + sum(sizes) + sum(ints)
    _afford(estimate + widths, what)


def _joinable(name: str, args: tuple) -> tuple:
    """``args`` with an iterator to be joined made a list, so that its length is known before the join (which
    consumes it all anyway)."""
    if name != "join":
        return args
    return tuple(list(a) if hasattr(a, "__next__") else a for a in args)


# ----------------------------------------------------------------------------------------------------------
# The guarded sandbox
# ----------------------------------------------------------------------------------------------------------


class _ChargingCodeGenerator(CodeGenerator):
    """Jinja's code generator, with every list, tuple and dict a template builds, every ``~`` and every slice
    charged."""

    def _wrapped(self, visit: Callable, node, frame, what: str) -> None:
        self.write("environment.charged(")
        visit(node, frame)
        self.write(f", {what!r})")

    def visit_List(self, node, frame) -> None:
        self._wrapped(super().visit_List, node, frame, "a list")

    def visit_Dict(self, node, frame) -> None:
        self._wrapped(super().visit_Dict, node, frame, "a dict")

    def visit_Tuple(self, node, frame) -> None:
        if node.ctx == "load":  # not a loop's or a set's targets
            self._wrapped(super().visit_Tuple, node, frame, "a tuple")
        else:
            super().visit_Tuple(node, frame)

    def visit_Concat(self, node, frame) -> None:
        self._wrapped(super().visit_Concat, node, frame, "'~'")

    def visit_Getitem(self, node, frame) -> None:
        if isinstance(node.arg, nodes.Slice):  # slices bypass the environment's getitem
            self._wrapped(super().visit_Getitem, node, frame, "a slice")
        else:
            super().visit_Getitem(node, frame)


class _GuardedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with operators and calls sized before they run and what they make charged."""

    code_generator_class = _ChargingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})
    charged = staticmethod(_charged)

    def call_binop(self, context, operator, left, right):
        _charge(_binop_size(operator, left, right), f"'{operator}'")
        return super().call_binop(context, operator, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        method = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped by the sandbox
        name, receiver = getattr(method, "__name__", ""), getattr(method, "__self__", None)
        what = f"{name}()" if name else "a call"
        args = _joinable(name, args)
        widths = 0
        if isinstance(receiver, str) and name in ("format", "format_map"):
            widths = _format_widths(receiver, (*args, *kwargs.values()), braces=True)
        _check_call(what, name, receiver, args, kwargs, widths)
        return _charged(super().call(context, obj, *args, **kwargs), what)


def _guarded_filter(name: str, func: Callable) -> Callable:
    """The filter ``func`` with its arguments sized and its result charged as calls are; jinja's
    pass_context / pass_eval_context / pass_environment mark (which ``functools.wraps`` copies) still tells
    jinja what to pass first, and that is not sized."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        args = _joinable(name, args)
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        widths = 0
        if name == "format" and isinstance(value, str):
            widths = _format_widths(value, (*rest, *kwargs.values()), braces=False)
        _check_call(f"the filter {name}", name, value, rest, kwargs, widths)
        return _charged(func(*args, **kwargs), f"the filter {name}")

    return guarded


def _raise_exception(message):
    """transformers' ``raise_exception``: the template refuses the conversation with ``message``."""
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' non-escaping ``tojson``, its indent (spaces or a string) at most ``TOJSON_INDENT`` wide."""
    width = len(indent) if isinstance(indent, str) else indent
    if isinstance(width, int) and width > TOJSON_INDENT:
        raise _Refused(f"tojson indent {indent!r:.40} is wider than {TOJSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    """The time now as ``fmt`` writes it, a format at most ``STRFTIME_FORMAT`` characters long."""
    if isinstance(fmt, str) and len(fmt) > STRFTIME_FORMAT:
        raise _Refused(f"strftime_now's format is {len(fmt)} characters, more than {STRFTIME_FORMAT}")
    return datetime.now().strftime(fmt)


def _finalized(value):
    """A value about to be written, refused when writing it would pass ``TEMPLATE_OUTPUT`` characters."""
    if _size(value, TEMPLATE_OUTPUT) > TEMPLATE_OUTPUT:
        raise _Refused(f"writes more than {TEMPLATE_OUTPUT:,} characters")
    return value


def _joined(pieces) -> str:
    """jinja's join of a block's output (a macro's, a ``set`` block's), charged before it is made."""
    pieces = list(pieces)
    _charge(sum(map(len, pieces)), "joining output")
    return "".join(pieces)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """``template`` compiled in the guarded sandbox; call it under ``_limited`` (jinja folds constant filters
    while compiling)."""
    env = _GuardedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                          finalize=_finalized)
    env.concat = _joined
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    del env.globals["lipsum"]
    return env.from_string(template)


def _rendered(template: str, context: dict) -> str:
    """``template``'s output with ``context``, written piece by piece; refused past ``TEMPLATE_OUTPUT``."""
    pieces, written = [], 0
    for piece in _compiled(template).generate(**context):
        written += len(piece)
        if written > TEMPLATE_OUTPUT:
            raise _Refused(f"writes more than {TEMPLATE_OUTPUT:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _failure(error: BaseException) -> str:
    """What went wrong in a template, on one line."""
    if isinstance(error, TemplateSyntaxError):
        what = f"syntax error on line {error.lineno}: {error.message}"
    elif isinstance(error, _Raised):
        what = f"the template refused the conversation: {error}"
    elif isinstance(error, _Refused):
        what = str(error)
    elif isinstance(error, RecursionError):
        what = "recursion too deep (RecursionError)"
    else:
        what = f"{type(error).__name__}: {error}"
    return " ".join(what.split())[:500]


def render(template: str, context: dict) -> str:
    """``template`` rendered with ``context`` within the limits above; anything that goes wrong in it (a limit,
    a syntax error, an undefined name, its own ``raise_exception``, a type error, recursion...) is a ValueError
    saying what, on one line."""
    try:
        return _limited(lambda: _rendered(template, context))
    except (Exception, _Refused) as e:
        raise ValueError(_failure(e)) from e
