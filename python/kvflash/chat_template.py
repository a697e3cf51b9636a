"""Chat templates (``tokenizer.chat_template``) rendered with jinja2 in a sandboxed
environment set up the way ``transformers`` does it: ``raise_exception``,
``strftime_now`` and a ``tojson`` filter, trim_blocks and lstrip_blocks."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence


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
        return tmpl.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                           **variables)


def _make_jinja_env():
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
