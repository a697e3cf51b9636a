"""Chat templates (``tokenizer.chat_template``) rendered with jinja2 in a sandboxed
environment set up the way ``transformers`` does it: ``raise_exception``,
``strftime_now`` and a ``tojson`` filter, trim_blocks and lstrip_blocks.

A template comes with the model file, so it is untrusted input: besides jinja2's
sandbox (no attribute escapes, ranges of at most 100000), a render is bounded.  No
single operation may build a string or list longer than ``MAX_RENDER_CHARS``
(``'x' * 10**10``, ``'%10000000000d' % 1``, ``'{:>99999999999}'.format(1)``,
``'a'|center(10**10)``, an integer power of more than ``MAX_POWER_BITS`` bits), the
output may not exceed ``MAX_RENDER_CHARS``, and the template's own code may run at
most ``MAX_TEMPLATE_STEPS`` lines (nested loops).  Past a bound the render raises
``jinja2.exceptions.SecurityError`` saying which.
"""
from __future__ import annotations

import json
import math
import re
import sys
from datetime import datetime
from typing import Any, Mapping, Sequence

MAX_RENDER_CHARS = 8 << 20      # a rendered prompt of 8 Mi characters is far past any context
MAX_TEMPLATE_STEPS = 2_000_000  # lines of template code per render (a real chat template needs a few per message)
MAX_POWER_BITS = 4096
_WIDTH = re.compile(r"(\d{8,})")  # a width or precision of 10^7 or more in a format string


class ChatTemplates:
    """Compiles each template source once (the environment is made on first use)."""

    def __init__(self):
        self._env = None
        self._compiled: dict[str, Any] = {}

    def render(self, source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               variables: Mapping[str, Any]) -> str:
        tmpl = self._compiled.get(source)
        if tmpl is None:
            if self._env is None:
                self._env = _make_jinja_env()
            tmpl = self._env.from_string(source)
            self._compiled[source] = tmpl
        out, n = [], 0
        with _StepBudget(MAX_TEMPLATE_STEPS):
            for piece in tmpl.generate(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt, **variables):
                n += len(piece)
                if n > MAX_RENDER_CHARS:
                    _refuse(f"its output passed {MAX_RENDER_CHARS} characters")
                out.append(piece)
        return "".join(out)


def _refuse(what: str):
    from jinja2.exceptions import SecurityError
    raise SecurityError(f"chat template refused: {what} (a template that builds text or loops without bound; "
                        f"fix the template or pass chat_template=)")


class _StepBudget:
    """Counts the lines the template's compiled code runs (frames of "<template>"), and
    stops the render past the budget: jinja2 has no step limit of its own."""

    def __init__(self, steps: int):
        self.left = steps
        self.prev = None

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return self._local
        return self.prev(frame, event, arg) if self.prev else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left < 0:
                _refuse(f"it ran more than {MAX_TEMPLATE_STEPS} steps")
        return self._local

    def __enter__(self):
        self.prev = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.prev)
        return False


def _check_size(n) -> None:
    if n > MAX_RENDER_CHARS:
        _refuse(f"an operation would build {n} characters or items (at most {MAX_RENDER_CHARS})")


def _check_format(fmt) -> None:
    if isinstance(fmt, str):
        for m in _WIDTH.findall(fmt):
            _check_size(int(m))


def _check_args(args, kwargs) -> None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool):
            _check_size(a)


def _make_jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        # Intercepted operators are also never folded at compile time (jinja2 checks).
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    if isinstance(seq, (str, bytes, list, tuple)) and isinstance(k, int):
                        _check_size(len(seq) * k)
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                    if right * math.log2(abs(left)) > MAX_POWER_BITS:
                        _refuse(f"{left} ** {right} has more than {MAX_POWER_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                _check_format(left)
                _check_args(right if isinstance(right, tuple) else (right,), {})
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            if isinstance(getattr(__obj, "__self__", None), (str, bytes, list)):  # ljust(10**10), ...
                _check_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):  # str.format / format_map, however they are called
            if getattr(value, "__name__", "") in ("format", "format_map"):
                _check_format(getattr(value, "__self__", None))
            return super().wrap_str_format(value)

    class GenerationBlock(jinja2.ext.Extension):
        # transformers' {% generation %} ... {% endgeneration %} marks the assistant's tokens for training
        # masks (Laguna's templates use it); for a prompt it renders its body unchanged, in the enclosing
        # scope, as llama.cpp's template engine treats it.
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock])

    def bounded(f, check_format=False):
        def g(value, *args, **kwargs):
            _check_args(args, kwargs)
            if check_format:
                _check_format(value)
            return f(value, *args, **kwargs)
        return g

    for name in ("center", "indent", "wordwrap", "truncate"):
        env.filters[name] = bounded(env.filters[name])
    env.filters["format"] = bounded(env.filters["format"], check_format=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
