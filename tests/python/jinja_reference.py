"""Python's jinja2 configured as transformers' apply_chat_template configures it.

ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, a `generation` block tag that records the character spans of what it renders (as
transformers' AssistantTracker does), the globals raise_exception and strftime_now, and the
tojson filter as json.dumps(ensure_ascii=False) with the caller's key order. Written from
reading transformers' chat_template_utils.py; the test's reference, not Strata code.
"""

import datetime
import json

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(Extension):
    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.spans = None
        self.chunks = None

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_support")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _support(self, context, caller):
        rv = caller()
        if self.chunks is not None:
            start = len("".join(self.chunks))
            self.spans.append((start, start + len(rv)))
        return rv


def make_environment(now_seconds):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.fromtimestamp(now_seconds).strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(env, source, context):
    """{"ok": True, "text": ..., "spans": [[b, e], ...] in UTF-8 bytes} or {"ok": False, ...}."""
    try:
        template = env.from_string(source)
    except Exception as e:  # noqa: BLE001 - any parse failure is a result to compare
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "phase": "parse"}
    ext = next(e for e in env.extensions.values() if isinstance(e, _Generation))
    ext.chunks, ext.spans = [], []
    try:
        for chunk in template.generate(**context):
            ext.chunks.append(chunk)
        text = "".join(ext.chunks)
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        spans, ext.chunks, ext.spans = ext.spans, None, None
    byte_spans = [[len(text[:b].encode()), len(text[:e].encode())] for b, e in spans]
    return {"ok": True, "text": text, "spans": byte_spans}
