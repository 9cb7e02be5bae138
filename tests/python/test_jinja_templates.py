"""Strata's Jinja engine (data/chat_template.h) against Python's jinja2, byte for byte.

Drives the jinja_render tool (tests/data/jinja_render_main.cc; STRATA_JINJA_RENDER names it)
and compares each render, and the byte spans of its {% generation %} blocks, with jinja2
configured as transformers' apply_chat_template configures it (jinja_reference.py):

- hundreds of small templates, one construct, filter, test or method each, plus random
  expressions built from a fixed seed over a pool of values;
- the chat templates of Llama 3 / 3.1, Qwen 2.5, Qwen 3, Gemma 3, Mistral v0.1 / v3, Phi-4,
  DeepSeek V3 and a ChatML fine-tune with generation blocks (jinja_chat_templates.py), over
  conversations with system prompts, several turns, non-ASCII text, contents that begin or end
  with newlines, tool calls and results, add_generation_prompt and enable_thinking both ways.

Where jinja2 raises, the engine must fail too (the messages are not compared). Exits 77
(CTest SKIP_RETURN_CODE) when jinja2 is not importable or the tool is missing.
"""

import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import jinja_reference
    from jinja_chat_templates import TEMPLATES
except ImportError as _e:  # jinja2 missing: the __main__ block reports this and exits 77
    jinja_reference = None
    _IMPORT_ERROR = _e

SKIP = 77
TOOL = os.environ.get("STRATA_JINJA_RENDER", "")
NOW = 1721995200  # 26 Jul 2024, strftime_now's clock on both sides (TZ=UTC)

BASE_CONTEXT = {
    "bos_token": "<s>", "eos_token": "</s>",
    "x": {"a": 1, "b": [1, 2, "three"], "c": None, "d": {"e": "f"}},
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": " Hi\n"},
                 {"role": "assistant", "content": "h\u00e9llo \u4e16\u754c \U0001F600"}],
    "s": "Hello World", "u8": "na\u00efve caf\u00e9 \u4e2d\u6587", "n": 3, "f": 2.5, "neg": -7,
    "e": [], "ed": {}, "t": True, "no": False, "z": 0, "nums": [3, 1, 2, 10],
    "words": ["b", "A", "a", "B"], "ws": "  \t padded \n ",
}

CONSTRUCTS = r"""
{{ 'a' ~ 1 ~ none ~ true ~ 1.5 }}|{{ 'x' * 3 }}|{{ [1] * 2 }}|{{ 1 + 2.0 }}|{{ true + 1 }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 7.5 % 2 }} {{ 2 ** 10 }} {{ 2 ** -2 }} {{ 10 / 4 }}
{{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ -0.0 }} {{ 1.5e300 * 1 }} {{ 3.0 }}
{{ [1, 'a', none, true, 2.5, (1,), (), {'k': 'v'}] }}|{{ ('a', "b'c", 'd"e') }}
{{ x }}|{{ x.b }}|{{ x['d'] }}|{{ messages[0] }}
{{ 1 == 1.0 }}{{ 'a' != 'b' }}{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ [1, 2] < [1, 3] }}{{ 'B' < 'a' }}
{{ 'ell' in s }}{{ 1 in nums }}{{ 'a' in x }}{{ 'zz' not in s }}{{ 5 not in nums }}
{{ not t }}{{ t and n }}{{ no or 'alt' }}{{ z or e or 'last' }}{{ t and no }}
{{ s[0] }}{{ s[-1] }}{{ s[1:4] }}{{ s[::-1] }}{{ s[::2] }}{{ s[-3:] }}{{ s[:100] }}{{ s[5:1:-1] }}
{{ u8[1:4] }}|{{ u8[::-1] }}|{{ u8|length }}|{{ u8[-2] }}|{{ u8|reverse }}|{{ u8|list }}
{{ nums[1:] }}{{ nums[::-1] }}{{ nums[-1] }}{{ nums[9] }}|{{ messages[-1].role }}
{{ 1 if t else 2 }}{{ 1 if no else 2 }}{{ 1 if no }}{{ (1 if no) is defined }}
{% if n > 2 %}big{% elif n > 1 %}mid{% else %}small{% endif %}
{% if e %}nonempty{% else %}empty{% endif %}{% if ed %}y{% else %}n{% endif %}{% if z %}y{% else %}n{% endif %}
{% for i in nums %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }},{% endfor %}
{% for i in nums %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('a', 'b', 'c') }};{% endfor %}
{% for i in nums if i > 1 %}{{ i }}/{{ loop.length }}{% else %}none{% endfor %}
{% for i in e %}{{ i }}{% else %}empty{% endfor %}
{% for k, v in x.items() %}{{ k }}={{ v }};{% endfor %}
{% for k in x %}{{ k }}{% endfor %}{% for c in 'h\u00e9' %}[{{ c }}]{% endfor %}
{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}
{% for i in range(10) %}{% if i is even %}{% continue %}{% endif %}{% if i > 6 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for i in range(3) %}{% for j in range(i) %}{{ i }}{{ j }} {% endfor %}{% endfor %}
{% set v = 1 %}{% for i in range(3) %}{{ v }}{% set v = 5 %}{{ v }}{% endfor %}{{ v }}
{% set ns = namespace(c=0, items=[]) %}{% for i in range(4) %}{% set ns.c = ns.c + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.c }}{{ ns.items }}
{% set a, b = 'xy' %}{{ b }}{{ a }}{% set t2 = 1, 2 %}{{ t2 }}
{% set block %}  inner {{ n }}
{% endset %}[{{ block }}]
{% set upper_block | upper | trim %} abc {% endset %}[{{ upper_block }}]
{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }}{{ greet('B', '?') }}{{ greet(punct='.', name='C') }}{{ greet() }}
{% macro rec(k) %}{% if k > 0 %}{{ k }}{{ rec(k - 1) }}{% endif %}{% endmacro %}{{ rec(5) }}
{% macro uses_top() %}{{ s }}{{ n }}{% endmacro %}{% for n in [9] %}{{ uses_top() }}{% endfor %}
{% filter upper %}shout {{ s }}{% endfilter %}
{% set leak = 'out' %}{% filter upper %}{% set leak = 'in' %}{{ leak }}{% endfilter %}{{ leak }}{% set ns3 = namespace(v=0) %}{% filter upper %}{% set ns3.v = 2 %}{% endfilter %}{{ ns3.v }}
{% for i in [1, 2] %}{% macro shows(k) %}{{ i }}{{ k }}{{ s }}{% endmacro %}{{ shows('x') }}{% endfor %}|{% macro outer(a) %}{% macro inner(b) %}{{ a }}{{ b }}{% endmacro %}{{ inner(a + 1) }}{% endmacro %}{{ outer(5) }}|{% for i in [1] %}{% macro m2(i) %}{{ i }}{% endmacro %}{{ m2(3) }}{% endfor %}
{{ 'ßa bß'.title() }}{{ 'ǆx'.title() }}{{ 'ßa'.capitalize() }}{{ 'ßa bß'|title }}{{ 'ǆx'|title }}
{% raw %}{{ raw }}{% endraw %}
{{ 'x'|upper }}{{ 'X'|lower }}{{ 'hello world'|capitalize }}{{ 'hello-world (x)'|title }}{{ s|title }}
{{ ws|trim }}|{{ 'xxaxx'|trim('x') }}|{{ s|replace('l', 'L') }}|{{ s|replace('l', 'L', 1) }}|{{ s|replace('', '-') }}
{{ nums|length }}{{ s|length }}{{ x|length }}{{ e|count }}{{ undefined_thing|length }}
{{ nums|join(', ') }}|{{ nums|join }}|{{ messages|join(' ', attribute='role') }}
{{ y|default('d') }}{{ x.zz|default('dz') }}{{ ''|default('d2', true) }}{{ ''|default('d3') }}{{ none|d('d4', true) }}
{{ messages|map(attribute='role')|list }}{{ nums|map('string')|join('+') }}{{ messages|map(attribute='nope', default='?')|list }}
{{ messages|selectattr('role', 'equalto', 'user')|list }}{{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|list }}
{{ nums|select('odd')|list }}{{ nums|reject('odd')|list }}{{ nums|select('gt', 2)|list }}{{ [0, 1, '', 'a', none]|select|list }}
{{ messages|selectattr('content')|list|length }}{{ x|items|list }}{{ undefined_thing|items|list }}
{{ nums|first }}{{ nums|last }}{{ s|first }}{{ s|last }}{{ e|first }}|{{ nums|min }}{{ nums|max }}{{ nums|sum }}{{ words|min }}
{{ nums|sort }}{{ nums|sort(reverse=true) }}{{ words|sort }}{{ words|sort(case_sensitive=true) }}{{ messages|sort(attribute='role')|map(attribute='role')|list }}
{{ words|unique|list }}{{ words|unique(case_sensitive=true)|list }}{{ x.d|dictsort }}{{ {'b': 2, 'A': 1, 'a': 0}|dictsort }}{{ {'b': 2, 'a': 1}|dictsort(by='value', reverse=true) }}
{{ nums|reverse|list }}{{ s|reverse }}{{ 'abc'|list }}{{ x.d|list }}
{{ '42'|int }}{{ ' 7 '|int }}{{ '4.9'|int }}{{ 'x'|int }}{{ 'x'|int(5) }}{{ 3.99|int }}{{ true|int }}{{ '0x1A'|int(0, 16) }}{{ none|int }}
{{ '1.5'|float }}{{ 'x'|float }}{{ 3|float }}{{ ' 2e3 '|float }}{{ '1_000'|int }}
{{ neg|abs }}{{ -2.5|abs }}{{ 2.5|round }}{{ 3.5|round }}{{ 2.675|round(2) }}{{ 2.1|round(0, 'ceil') }}{{ 2.9|round(0, 'floor') }}{{ 7|round }}
{{ s|indent }}|{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb\n\nc'|indent(2, true) }}|{{ 'a\nb\n\nc'|indent(2, blank=true) }}|{{ 'a\nb'|indent('> ') }}
{{ 'one two  three'|wordcount }}{{ s|center(21) }}|{{ nums|batch(3)|list }}{{ nums|batch(3, 0)|list }}
{{ '<a href="x">&\'</a>'|e }}{{ '<b>'|escape }}{{ '<i>'|safe }}{{ none|string }}{{ 12|string }}
{{ x|tojson }}{{ messages|tojson }}{{ x|tojson(indent=2) }}{{ [1, [2, {}], []]|tojson(indent=1) }}{{ 'h\u00e9\n"\\\t'|tojson }}{{ {'k': 1.0, 'z': none, 't': true}|tojson }}
{{ x|tojson(sort_keys=true) }}{{ [1, 2]|tojson(separators=(',', ':')) }}{{ 'é'|tojson(ensure_ascii=true) }}{{ (1, 2)|tojson }}
{{ s.upper() }}{{ s.lower() }}{{ s.title() }}{{ 'abc def'.capitalize() }}{{ s.startswith('He') }}{{ s.endswith(('x', 'ld')) }}{{ s.startswith(('x', 'y')) }}
{{ ws.strip() }}|{{ ws.lstrip() }}|{{ ws.rstrip() }}|{{ s.strip('Hd') }}|{{ '\n\nx\n'.lstrip('\n') }}|{{ 'x\n\n'.rstrip('\n') }}
{{ ' a  b '.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a b c'.split(' ', 1) }}{{ 'a b c'.rsplit(' ', 1) }}{{ '  a  b  c  '.split(none, 1) }}{{ '  a  b  c  '.rsplit(none, 1) }}{{ 'a</think>b'.split('</think>')[-1] }}
{{ s.replace('o', '0') }}{{ s.find('o') }}{{ s.rfind('o') }}{{ s.find('zz') }}{{ s.count('l') }}{{ '-'.join(['a', 'b']) }}{{ 'a\nb\r\nc'.splitlines() }}
{{ '12'.isdigit() }}{{ 'ab'.isalpha() }}{{ 'ab'.islower() }}{{ 'AB'.isupper() }}{{ ' '.isspace() }}
{{ x.get('a') }}{{ x.get('zz') }}{{ x.get('zz', 'dflt') }}{{ x.keys()|list }}{{ x.values()|list }}{{ x.items()|list }}{{ nums.index(2) }}{{ nums.count(3) }}
{{ x.zz is defined }}{{ x.a is defined }}{{ y is undefined }}{{ x.c is none }}{{ n is number }}{{ f is float }}{{ n is integer }}{{ t is boolean }}{{ t is true }}{{ no is false }}
{{ s is string }}{{ x is mapping }}{{ nums is iterable }}{{ s is sequence }}{{ n is iterable }}{{ greet is callable }}{{ n is odd }}{{ n is even }}{{ 9 is divisibleby 3 }}{{ n is divisibleby(2) }}
{{ n is eq 3 }}{{ n is equalto 3 }}{{ n is ne 3 }}{{ n is lt 4 }}{{ n is gt 4 }}{{ n is le 3 }}{{ n is ge 4 }}{{ 1 is in nums }}{{ 'Hello' is in s }}{{ none is sameas none }}{{ s is lower }}{{ 'ABC' is upper }}{{ 'upper' is filter }}{{ 'odd' is test }}
{{ ns is defined }}{% set ns2 = namespace(x=1) %}{{ ns2.x }}{{ ns2.nope is defined }}
{{ dict(a=1, b=[2]) }}{{ range(5)|list }}{{ range(1, 10, 3)|list }}{{ range(5, 0, -2)|list }}
{{ '%s and %s' % ('a', 1) }}{{ '%d%%' % 50 }}{{ '%r' % 'q' }}
{{ strftime_now('%Y-%m-%d %H:%M') }}{{ strftime_now('%d %b %Y') }}
{# a comment #}a{#- trimmed -#}   b  {{- ' c ' -}}  d
  {%- if true %} e {% endif -%}
  f
    {% if true %}
g
    {% endif %}
h {%+ if true %}i{% endif %}
{% if true +%}
j
{% endif %}
  {# comment at line start #}
k
{% generation %}G{{ n }}{% endgeneration %} \u00e9 {% generation %}{{ u8 }}{% endgeneration %}
{% for m in messages %}{% generation %}{{ m.role }}{% endgeneration %},{% endfor %}
{{ messages[1].content }}|{{ messages[1]['content']|trim }}|{{ x.d.e }}|{{ x['b'][2] }}|{{ x.b.2 }}
{{ raise_exception('boom ' ~ n) }}
{{ undefined_thing.attr }}
{{ undefined_thing + 1 }}
{{ x.zz.deeper }}
{{ 1 + 'a' }}
{{ 'a' + 1 }}
{{ nums < 'a' }}
{{ 1 / 0 }}
{{ nums.append(4) }}
{{ x.update({}) }}
{{ s|nonexistent_filter }}
{{ n is nonexistent_test }}
{% for a, b in nums %}{% endfor %}
{{ range(1000000)|length }}
{% include 'other.j2' %}
{% extends 'base.j2' %}
{% for i in nums %}
{% if t %}{% endfor %}
{{ 1 + }}
{{ 'unterminated }}
{% endif %}
{{ }}
{% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }}
{% macro m(a) %}{{ a }}{% endmacro %}{{ m(b=2) }}
{% set q = 1 %}{{ q.attr }}
{{ none.attr }}|{{ (none.attr) is defined }}
{{ "é"|upper }}{{ "ÀÉ"|lower }}{{ 'ß'|upper }}{{ 'ǅ'|lower }}
{{ 'a\\nb' }}|{{ "tab\there" }}|{{ '\u00e9\x41' }}|{{ 'it\'s' }}|{{ ["it's"] }}|{{ ['a\nb'] }}|{{ ['\u00e9', '\x07'] }}
"""

EXPR_VALUES = ["1", "2", "0", "-3", "2.5", "0.1", "'ab'", "'B'", "''", "[1, 2]", "[]", "(1,)",
               "{'k': 1}", "none", "true", "false", "n", "s", "nums", "x", "e", "x.b", "f",
               "messages|length", "'é'"]
EXPR_BINOPS = ["+", "-", "*", "/", "//", "%", "~", "==", "!=", "<", ">=", "and", "or", "in",
               "not in", "**"]
EXPR_UNARY = ["-", "not ", ""]
EXPR_FILTERS = ["length", "string", "list", "first", "last", "upper", "trim", "int", "float",
                "abs", "round", "reverse|list", "sort", "unique|list", "tojson", "default('d')",
                "join('-')", "count", "lower", "title", "capitalize", "e", "items|list",
                "dictsort", "select|list", "sum", "min", "max"]
EXPR_TESTS = ["defined", "none", "string", "number", "integer", "float", "mapping", "iterable",
              "sequence", "odd", "even", "true", "false", "boolean", "eq 1", "divisibleby 2"]


def random_expressions(count, seed=20240726):
    rng = random.Random(seed)

    def expr(depth):
        r = rng.random()
        if depth <= 0 or r < 0.3:
            return rng.choice(EXPR_VALUES)
        if r < 0.55:
            return f"({expr(depth - 1)} {rng.choice(EXPR_BINOPS)} {expr(depth - 1)})"
        if r < 0.7:
            return f"{rng.choice(EXPR_UNARY)}{expr(depth - 1)}"
        if r < 0.85:
            return f"({expr(depth - 1)})|{rng.choice(EXPR_FILTERS)}"
        if r < 0.93:
            return f"({expr(depth - 1)} is {rng.choice(EXPR_TESTS)})"
        return f"({expr(depth - 1)} if {expr(depth - 1)} else {expr(depth - 1)})"

    return ["{{ " + expr(3) + " }}" for _ in range(count)]


def tool_context():
    return [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place, \u00b0C.",
            "parameters": {"type": "object",
                           "properties": {"city": {"type": "string", "description": "City"},
                                          "days": {"type": "integer"}},
                           "required": ["city"]},
            "return": {"type": "string"}}}]


def conversations():
    tc = {"id": "abc123XYZ", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Z\u00fcrich", "days": 2}}}
    tc_str = {"id": "abc123XYZ", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    simple = [{"role": "user", "content": "Hello!"}]
    multi = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4"},
             {"role": "user", "content": "\nAnd in French?\n"},
             {"role": "assistant", "content": "Quatre.\n\n"},
             {"role": "user", "content": "Merci \u2014 \u65e5\u672c\u8a9e \U0001F389"}]
    no_system = multi[1:]
    thinking = [{"role": "user", "content": "Think: 3*7?"},
                {"role": "assistant", "content": "<think>\n3*7 is 21.\n</think>\n\n21"},
                {"role": "user", "content": "And 4*5?"},
                {"role": "assistant", "content": "20", "reasoning_content": "4 times 5."}]
    tools_conv = [{"role": "system", "content": "Use tools."},
                  {"role": "user", "content": "Weather in Z\u00fcrich?"},
                  {"role": "assistant", "content": "", "tool_calls": [tc]},
                  {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "abc123XYZ"},
                  {"role": "tool", "content": "sunny", "tool_call_id": "abc123XYZ"},
                  {"role": "assistant", "content": "21 \u00b0C and sunny."}]
    deepseek_tools = [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [tc_str]},
                      {"role": "tool", "content": "rain"},
                      {"role": "assistant", "content": "It rains."}]
    gemma_parts = [{"role": "system", "content": [{"type": "text", "text": "Sys."}]},
                   {"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": " Describe. "}]},
                   {"role": "assistant", "content": "A cat."}]
    bad_alternation = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    return {"simple": simple, "multi": multi, "no_system": no_system, "thinking": thinking,
            "tools": tools_conv, "deepseek_tools": deepseek_tools, "gemma_parts": gemma_parts,
            "bad_alternation": bad_alternation}


def model_cases():
    """(template name, context) pairs."""
    convs = conversations()
    cases = []
    for name in TEMPLATES:
        for conv_name, conv in convs.items():
            for gen in (False, True):
                ctx = {"messages": conv, "bos_token": "<s>", "eos_token": "</s>",
                       "add_generation_prompt": gen}
                cases.append((name, ctx))
                if name in ("llama3.1", "qwen2.5", "qwen3", "mistral-v3") and conv_name in (
                        "tools", "multi", "simple"):
                    cases.append((name, dict(ctx, tools=tool_context())))
                if name == "qwen3":
                    cases.append((name, dict(ctx, enable_thinking=False)))
                    cases.append((name, dict(ctx, enable_thinking=True)))
                if name == "llama3.1":
                    cases.append((name, dict(ctx, date_string="1 Jan 2025",
                                             builtin_tools=["brave_search", "code_interpreter"])))
                    cases.append((name, dict(ctx, tools=tool_context(),
                                             tools_in_user_message=False)))
    return cases


@unittest.skipIf(jinja_reference is None, "jinja2 is not importable")
class JinjaTemplatesAgainstJinja2(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.env = jinja_reference.make_environment(NOW)
        cls.tmp = tempfile.TemporaryDirectory()
        cls.count = 0

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def render_cpp(self, source, contexts):
        tpath = os.path.join(self.tmp.name, "t.jinja")
        cpath = os.path.join(self.tmp.name, "c.json")
        with open(tpath, "w", encoding="utf-8") as f:
            f.write(source)
        with open(cpath, "w", encoding="utf-8") as f:
            json.dump(contexts, f, ensure_ascii=False)
        out = subprocess.run([TOOL, tpath, cpath, f"--now={NOW}"], capture_output=True,
                             timeout=60, env=dict(os.environ, TZ="UTC"))
        self.assertEqual(out.returncode, 0, out.stderr.decode(errors="replace"))
        lines = out.stdout.decode("utf-8").splitlines()
        results = [json.loads(line) for line in lines]
        if len(results) == 1 and results[0].get("phase") == "parse":
            results = results * len(contexts)
        return results

    def compare(self, source, contexts, label):
        mine = self.render_cpp(source, contexts)
        for ctx, got in zip(contexts, mine):
            want = jinja_reference.render(self.env, source, ctx)
            if want["ok"] and "<generator object" in want["text"]:
                continue  # jinja2 prints a generator's repr where the engine has a list
            type(self).count += 1
            with self.subTest(label=label, template=source[:200]):
                if not want["ok"]:
                    self.assertFalse(got["ok"], f"jinja2 raised {want['error']}; got {got}")
                    continue
                self.assertTrue(got["ok"], f"engine failed: {got}; jinja2 gave {want}")
                self.assertEqual(got["text"], want["text"])
                self.assertEqual(got["spans"], want["spans"])
                if got["ok"] is False:
                    self.assertNotIn("\n", got["error"])

    def test_each_construct_matches_jinja2(self):
        for line in CONSTRUCTS.strip("\n").split("\n"):
            self.compare(line, [BASE_CONTEXT], "construct")
        # The whitespace block as one template (trim_blocks / lstrip_blocks across lines).
        lines = CONSTRUCTS.split("\n")
        start = next(k for k, l in enumerate(lines) if l.startswith("{# a comment #}"))
        end = next(k for k, l in enumerate(lines) if l.startswith("k"))
        self.compare("\n".join(lines[start:end + 1]) + "\n", [BASE_CONTEXT], "whitespace")
        self.compare("\n".join(lines[start:end + 1]) + "\n\n", [BASE_CONTEXT], "trailing")
        self.compare("a\r\nb\r{% if true %}\r\nc{% endif %}\r\n", [BASE_CONTEXT], "crlf")

    def test_random_expressions_match_jinja2(self):
        for source in random_expressions(400):
            self.compare(source, [BASE_CONTEXT], "random")

    def test_model_chat_templates_match_jinja2(self):
        by_template = {}
        for name, ctx in model_cases():
            by_template.setdefault(name, []).append(ctx)
        for name, contexts in by_template.items():
            self.compare(TEMPLATES[name], contexts, name)


if __name__ == "__main__":
    if jinja_reference is None:
        print(f"SKIP: jinja2 is not importable ({_IMPORT_ERROR})")
        sys.exit(SKIP)
    if not TOOL or not os.path.exists(TOOL):
        print("SKIP: STRATA_JINJA_RENDER does not name the jinja_render tool")
        sys.exit(SKIP)
    result = unittest.main(exit=False, verbosity=1).result
    print(f"compared {JinjaTemplatesAgainstJinja2.count} renders with jinja2")
    sys.exit(0 if result.wasSuccessful() else 1)
