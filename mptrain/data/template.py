"""Rendering a chat template within bounds on its time and on the size of what it makes.

A chat template is user input: a folder's `tokenizer_config.json` or a setting's text. Jinja2's
sandbox keeps a template from reaching Python's internals, but bounds neither its time nor its
memory: three nested loops run for hours, and `'x' * 10**9` or a doubling `~` takes the machine's
memory. mptrain renders a template as `transformers` does (a sandboxed environment with
`trim_blocks` and `lstrip_blocks`, `raise_exception()`, a `tojson` filter) and holds each render
to a `Template`'s two bounds (`data.template_max_seconds`, `data.template_max_chars`):

  * time: a render that runs past `max_seconds` stops with an error (a timer signal on the
    main thread; elsewhere a check on every line the render runs);
  * size: every string, list or number a template makes through an operator (`*`, `**`, `+`,
    `%`, `~`), a call or a filter, and the rendered text itself, holds at most `max_chars`
    characters (items, or digits). The operations that can multiply a size in one step are
    checked before they run: `*` and `**`, `join`, `replace`, `indent`, the width of `center`,
    `ljust`, `rjust`, `zfill` and `expandtabs`, the widths a `%` or `format` string asks for,
    and the fill of `batch` and `slice`. Jinja's `lipsum`, which no chat template needs, is
    gone. A template's error of any kind (an undefined name, a division by zero, a recursion
    past Python's limit) is a `ValueError` that names the template, as the bounds' are.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import signal
import sys
import threading
import time
from typing import Any

MAX_CHARS = 4_000_000  # about a million tokens: past any context a run trains on
MAX_SECONDS = 2.0  # a chat template renders a conversation in well under a millisecond
MAX_SECONDS_AT_MOST = 3600.0  # what the bound on time may be set to


@dataclasses.dataclass(frozen=True)
class Template:
    """A chat template: its Jinja2 `text`, its `source` as errors name it ("the built-in
    'llama3'", "the chat_template of DIR/tokenizer_config.json"), the bounds on one render, and
    what sets them as a bound's error names it (`bounds + "seconds"`: a run's config keys, or
    `mptrain.generate`'s flags)."""

    text: str
    source: str = "data.chat_template"
    max_chars: int = MAX_CHARS
    max_seconds: float = MAX_SECONDS
    bounds: str = "data.template_max_"


class _Exceeded(Exception):
    """A bound reached; the message says which (without the template's name)."""


# A `{% generation %}` block's text is marked by these in the rendered text, then taken out:
# characters of Unicode's private use area, which a conversation holding them is refused for.
OPEN, CLOSE = "\ue000", "\ue001"
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def has_generation(template: Template) -> bool:
    """Whether `template` marks what the assistant generates (`{% generation %}` blocks, as
    TRL asks of templates for assistant-only loss)."""
    return bool(_GENERATION.search(template.text))


def render(template: Template, **context: Any) -> str:
    """The text of `template` under `context` (`messages`, `add_generation_prompt`, the
    tokens); a `ValueError` naming the template says why it does not render."""
    return render_marked(template, **context)[0]


def render_marked(template: Template, **context: Any) -> tuple[str, list[tuple[int, int]]]:
    """`render`'s text and the `(start, end)` character spans of its `{% generation %}` blocks
    (transformers' `AssistantTracker` finds the same spans)."""
    try:
        compiled = _compiled(template.text, template.max_chars)
        with _deadline(template.max_seconds):
            marked = compiled.render(**context)
    except _Exceeded as e:  # its message names the bound as {bounds}seconds or {bounds}chars
        why = str(e).replace("{bounds}", template.bounds)
        raise ValueError(f"the chat template ({template.source}) {why}") from None
    except RecursionError:
        why = "recursed past Python's limit"
        raise ValueError(f"the chat template ({template.source}) {why}") from None
    except Exception as e:  # a template's own error (raise_exception, an undefined name, ...)
        from jinja2.exceptions import TemplateError

        kind = "" if isinstance(e, TemplateError) else f"{type(e).__name__}: "
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"the chat template ({template.source}) does not render it: {kind}{first}"
        ) from None
    return _unmarked(marked, template)


def _unmarked(marked: str, template: Template) -> tuple[str, list[tuple[int, int]]]:
    """The text without its markers, and the spans they marked."""
    if OPEN not in marked and CLOSE not in marked:
        return marked, []
    parts, spans, at = re.split(f"([{OPEN}{CLOSE}])", marked), [], 0
    text, start = [], None
    for part in parts:
        if part == OPEN and start is None:
            start = at
        elif part == CLOSE and start is not None:
            spans.append((start, at))
            start = None
        elif part in (OPEN, CLOSE):
            raise ValueError(
                f"the chat template ({template.source}) renders the characters U+E000 or "
                "U+E001 (the conversation holds them, or a generation block nests)"
            )
        else:
            text.append(part)
            at += len(part)
    return "".join(text), spans


# ---- time ----------------------------------------------------------------------------------


class _Timer:
    """The deadline of the render in progress on the main thread (SIGALRM's handler reads it,
    so a signal that lands after the render ended does nothing)."""

    active = False


def _on_alarm(signum, frame):
    if _Timer.active:
        _Timer.active = False
        raise _Exceeded(f"ran past {{bounds}}seconds={_Timer.seconds:g}")


class _deadline:
    """Within the block, the render stops with `_Exceeded` once `seconds` have passed."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGALRM)
            if self.previous not in (_on_alarm, signal.SIG_DFL):  # another's: put back after
                signal.signal(signal.SIGALRM, _on_alarm)
            elif self.previous is signal.SIG_DFL:  # nobody's: ours stays (it acts only here)
                signal.signal(signal.SIGALRM, _on_alarm)
                self.previous = _on_alarm
            _Timer.active, _Timer.seconds = True, self.seconds
            self.timer = signal.setitimer(signal.ITIMER_REAL, self.seconds)
        else:  # no signal reaches another thread: look at the clock on every line
            end, self.timer = time.monotonic() + self.seconds, None

            def tracer(frame, event, arg):
                if time.monotonic() > end:
                    raise _Exceeded(f"ran past {{bounds}}seconds={self.seconds:g}")
                return tracer

            self.previous = sys.gettrace()
            sys.settrace(tracer)
        return self

    def __exit__(self, *exc):
        if self.timer is None:
            sys.settrace(self.previous)
            return
        _Timer.active = False
        signal.setitimer(signal.ITIMER_REAL, *self.timer)  # another timer's, if one was set
        if self.previous is not _on_alarm:
            signal.signal(signal.SIGALRM, self.previous)


# ---- size ----------------------------------------------------------------------------------

_NUMBER = re.compile(r"\d+")


def _length(value: Any) -> int:
    """A value's size as the bound counts it: characters, items, or decimal digits."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return int(value.bit_length() * math.log10(2)) + 1
    try:
        return len(value)
    except TypeError:
        return 1


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _widths(spec: Any) -> int:
    """The largest number a `%` or `format` string holds (a width or a precision)."""
    return max(map(int, _NUMBER.findall(spec)), default=0) if isinstance(spec, str) else 0


def _joined(sep: Any, items: list) -> int:
    return sum(_length(str(x)) for x in items) + max(0, len(items) - 1) * _length(sep)


def _replaced(s: Any, old: Any, new: Any, count: Any = None) -> int:
    if not all(isinstance(x, str) for x in (s, old, new)):
        return 0
    found = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(s) + found * max(0, len(new) - len(old))


def _indented(s: Any, width: Any = 4, *rest: Any) -> int:
    lines = s.count("\n") + 1 if isinstance(s, str) else 1
    return _length(s) + lines * (len(width) if isinstance(width, str) else _int(width))


def _padded(s: Any, width: Any = 0, *rest: Any) -> int:
    return max(_length(s), _int(width))


# What a str method or a filter of this name will make, in `_length`'s units, from its
# arguments (the string, or the filter's value, first); checked before it runs.
_METHODS = {
    "center": _padded,
    "ljust": _padded,
    "rjust": _padded,
    "zfill": _padded,
    "expandtabs": lambda s, n=8: len(s) + s.count("\t") * _int(n),
    "join": lambda sep, items=(): _joined(sep, items),
    "replace": _replaced,
    "format": lambda spec, *args, **kw: _widths(spec),
    "format_map": lambda spec, *args: _widths(spec),
}
_FILTERS = {
    "center": _padded,
    "join": lambda items, sep="", *rest: _joined(sep, items),
    "replace": _replaced,
    "indent": _indented,
    "format": lambda spec, *args, **kw: _widths(spec),
    "batch": lambda value, count=1, *rest: _int(count),
    "slice": lambda value, count=1, *rest: _int(count),
}


def _tojson(value: Any, indent: Any = None, **kwargs: Any) -> str:
    """transformers' `tojson`: `json.dumps` without ASCII escapes; an indent of at most 16."""
    if (isinstance(indent, int) and indent > 16) or (isinstance(indent, str) and len(indent) > 16):
        raise _Exceeded(f"asked tojson for an indent of {indent!r}, past 16")
    return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)


@functools.lru_cache(maxsize=16)
def _compiled(text: str, max_chars: int):
    """A template's text compiled under the bound `max_chars`."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def too_big(what: str, size: int):
        raise _Exceeded(f"{what} of {size:,} characters, past {{bounds}}chars={max_chars:,}")

    def sized(value: Any) -> Any:
        if (size := _length(value)) > max_chars:
            too_big("made a value", size)
        return value

    def checked(table: dict, name: str, args: tuple) -> tuple:
        """`args` (a generator to join made a list); raises if `name` would make too much."""
        at = 1 if table is _METHODS else 0  # the items to join
        if name == "join" and len(args) > at and not isinstance(args[at], list | tuple | str):
            args = (*args[:at], list(args[at]), *args[at + 1 :])
        if (size := table[name](*args)) > max_chars:
            too_big(f"asked {name} for a value", size)
        return args

    class Generation(Extension):  # `{% generation %}...{% endgeneration %}`: its text marked
        tags = frozenset(("generation",))

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return f"{OPEN}{caller()}{CLOSE}"

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: its result is checked
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(")")

    class Bounded(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(("*", "**", "+", "%"))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                counts = [(x, n) for x, n in ((left, right), (right, left)) if isinstance(n, int)]
                for x, n in counts:
                    if not isinstance(x, int | float) and _length(x) * n > max_chars:
                        too_big(f"asked {operator} for a value", _length(x) * n)
            elif operator == "**" and isinstance(right, int) and isinstance(left, int):
                digits = right * math.log10(max(2, abs(left)))
                if abs(left) > 1 and digits > max_chars:
                    too_big("asked ** for a number", int(digits))
            elif operator == "%" and isinstance(left, str):
                numbers = right if isinstance(right, tuple) else (right,)
                widest = max([_widths(left)] + ["*" in left and _int(n) for n in numbers])
                if widest > max_chars:
                    too_big("asked % for a width", widest)
            return sized(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):
            return sized(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            return self._guarded(obj, attribute, super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            return self._guarded(obj, argument, super().getitem(obj, argument))

        def _guarded(self, obj, name, value):
            if not (isinstance(obj, str) and name in _METHODS and callable(value)):
                return value

            @functools.wraps(value)
            def method(*args, **kwargs):
                args = checked(_METHODS, name, (obj, *args))[1:]
                return value(*args, **kwargs)

            return method

    def filtered(name: str, f: Any) -> Any:
        passed = getattr(f, "jinja_pass_arg", None) is not None

        @functools.wraps(f)  # keeps `jinja_pass_arg`: Jinja passes the context as it did
        def bounded(*args, **kwargs):
            if name in _FILTERS:
                head, rest = args[:passed], args[passed:]
                args = (*head, *checked(_FILTERS, name, rest))
            return sized(f(*args, **kwargs))

        return bounded

    def concat(pieces) -> str:  # every buffer Jinja joins, and the rendered text
        out, size, pieces = [], 0, iter(pieces)
        while batch := list(itertools.islice(pieces, 16)):  # each piece is a bounded value
            size += sum(map(len, batch))
            if size > max_chars:
                too_big("rendered a text", size)
            out += batch
        return "".join(out)

    def raise_exception(message):
        raise TemplateError(message)

    environment = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    environment.sized, environment.concat = sized, concat
    environment.globals.pop("lipsum", None)
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = _tojson
    environment.filters = {k: filtered(k, f) for k, f in environment.filters.items()}
    return environment.from_string(text)
