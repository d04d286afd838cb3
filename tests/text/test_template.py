"""Chat template: rendering in the immutable sandbox, helpers, hostile templates, bounds."""

from __future__ import annotations

import json
import time

import pytest

from muser.errors import TemplateError, TemplateSecurityError
from muser.gguf.identity import template_sha256
from muser.gguf.reader import read_gguf
from muser.model.synth import CHAT_TEMPLATE
from muser.text import ChatTemplate
from muser.text.synth import LLAMA4_TEMPLATE


def test_render_synthetic_template(gpt2_gguf):
    f = read_gguf(gpt2_gguf)
    t = ChatTemplate.from_gguf(f)
    assert t.sha256 == template_sha256(f)  # 9.13: the identity the loader pins
    out = t.render([{"role": "user", "content": " Hi there "},
                    {"role": "assistant", "content": [{"type": "text", "text": "yo"}, {"type": "image"}]}])
    assert out == ("<|begin_of_text|><|start_header|>user<|end_header|>\n\nHi there<|eot|>"
                   "<|start_header|>assistant<|end_header|>\n\nyo<|eot|>"
                   "<|start_header|>assistant<|end_header|>\n\n")
    assert not t.render([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith("\n\n")


def test_tools_and_extra_variables():
    t = ChatTemplate(LLAMA4_TEMPLATE, "<|begin_of_text|>", "<|end_of_text|>")
    tools = [{"name": "get_weather", "description": "Wetter für Köln", "parameters": {"city": "str"}}]
    out = t.render([{"role": "user", "content": "?"}], tools=tools)
    assert json.dumps(tools, ensure_ascii=False) in out  # tojson keeps non-ASCII text
    t2 = ChatTemplate("{{ greeting }} {{ strftime_now('%Y') }}")
    assert t2.render([], greeting="hi").startswith("hi 20")


def test_raise_exception_is_a_template_error():
    t = ChatTemplate("{% if messages|length == 0 %}{{ raise_exception('need a message') }}{% endif %}")
    with pytest.raises(TemplateError, match="need a message"):
        t.render([])


def test_bad_input():
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError, match="must be a mapping"):
        ChatTemplate(CHAT_TEMPLATE).render([{"content": "no role"}])
    with pytest.raises(TemplateError, match="empty"):
        ChatTemplate("")


HOSTILE = {
    "dunder": "{{ ''.__class__.__mro__ }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "cycler": "{{ cycler.__init__ }}",
    "lipsum": "{{ lipsum(n=100000) }}",
    "joiner": "{{ joiner() }}",
    "computed_key": "{{ ''['__cla' ~ 'ss__'] }}",
    "attr_filter": "{{ ''|attr('__class__') }}",
    "mro": "{{ [].mro }}",
    "format_method": "{{ ('{:>9999' ~ '9999}')['for' ~ 'mat'](1) }}",
    "percent_format": "{{ '%0999999999d' % 1 }}",
    "repeat": "{{ 'x' * 100000000 }}",
    "doubling_namespace": "{% set ns = namespace(s='xx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling_macro": "{% macro d(s, n) %}{% if n > 0 %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ d('x', 64) }}",
    "long_concat": "{% set a = 'x' * 1000000 %}{{ (a ~ a ~ a ~ a ~ a)|length }}",
    "center": "{{ 'x'|center(999999999) }}",
    "ljust": "{{ 'x'.ljust(999999999) }}",
    "expandtabs": "{% set t = '\t' * 100000 %}{{ t.expandtabs(100) }}",
    "translate": "{{ 'abc'['trans' ~ 'late']({97: 'x' * 1000}) }}",
    "join_blowup": "{% set s = 'x' * 1000000 %}{{ [s, s, s, s, s]|join }}",
    "replace_blowup": "{% set s = 'x' * 100000 %}{{ s|replace('x', s) }}",
    "power": "{{ 2 ** 100000000 }}",
    "power_chain": "{{ (((10 ** 60) ** 60) ** 60) ** 60 }}",
    "int_squaring": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "recursion": "{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}",
    "import": "{% import 'os' as os %}",
    "include": "{% include 'x' %}",
    "filter_not_allowed": "{{ 'x'|format(1) }}",
    "output_flood": "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_are_stopped(name):
    t0 = time.monotonic()
    with pytest.raises(TemplateSecurityError):
        ChatTemplate(HOSTILE[name]).render([])
    assert time.monotonic() - t0 < 5.0


def test_time_bound():
    t = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TemplateSecurityError, match="exceeded"):
        t.render([])
    assert time.monotonic() - t0 < 3.0


def test_real_template_idioms_render():
    """What Llama-4-style templates use: namespace, loop controls, tests, str methods, filters."""
    src = (
        "{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' %}{% set ns.system = m.content | trim %}{% continue %}{% endif -%}"
        "{%- if m.content is string %}[{{ m.role | upper }}] {{ m.content.strip() }}"
        "{%- elif m.content is iterable %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
        "{{ p.text }}{% endfor %}{% endif %}{{ '\n' if not loop.last }}"
        "{%- endfor -%}"
        "{%- if ns.system %}|{{ ns.system }}{% endif %}"
        "{%- if tools %}|{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ ', '.join(['a', 'b']) }}{{ messages | length }}{{ 'a,b'.split(',') | join('+') }}"
    )
    out = ChatTemplate(src).render(
        [{"role": "system", "content": " sys "}, {"role": "user", "content": " hi "},
         {"role": "assistant", "content": [{"type": "text", "text": "yo"}, {"type": "image_url"}]}],
        tools=[{"name": "f"}])
    assert out == '[USER] hi\nyo|sys|[\n  {\n    "name": "f"\n  }\n]a, b3a+b'


def test_output_bound_is_configurable():
    t = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", max_output_chars=10)
    assert t.render([{"role": "user", "content": "12345"}]) == "12345"
    with pytest.raises(TemplateSecurityError):
        t.render([{"role": "user", "content": "123456789012"}])
