"""The Muse Glimmer turn parser on the cases the pinned llama.cpp checks for its muse-glimmer
parser (tests/test-chat.cpp), plus streaming (partial) behaviour and tool rendering."""

from __future__ import annotations

import json

from muser.server.chat import held_marker_suffix, parse_atem

TOOL = {"type": "function", "function": {"name": "special_function", "description": "I'm special", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer", "description": "The arg."}}, "required": ["arg1"]}}}
STR_TOOL = {"type": "function", "function": {"name": "echo", "description": "", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": ["integer", "null"]}}}}}
CALL = ("<atem:function_calls>\n<atem:invoke name=\"special_function\">\n"
        "<atem:parameter name=\"arg1\">1</atem:parameter>\n</atem:invoke>\n</atem:function_calls>")
HELLO = "Hello, world!\nWhat's up?"


def test_plain_answer():
    t = parse_atem(" to=user<|message|>" + HELLO)
    assert (t.content, t.reasoning, t.tool_calls) == (HELLO, "", [])


def test_answer_without_recipient():
    assert parse_atem("<|message|>" + HELLO).content == HELLO


def test_call_as_first_message():
    t = parse_atem(" to=special_function<|message|>" + CALL, [TOOL])
    assert t.content == "" and t.tool_calls == [{"name": "special_function", "arguments": '{"arg1":1}'}]


def test_inform_then_act():
    t = parse_atem(" to=user<|message|>" + HELLO + "<|eom|><|start|>assistant to=special_function<|message|>" + CALL,
                   [TOOL])
    assert t.content == HELLO
    assert t.tool_calls == [{"name": "special_function", "arguments": '{"arg1":1}'}]


def test_markup_quoted_in_an_answer_stays_content():
    text = "You invoke it like this:\n" + CALL
    t = parse_atem(" to=user<|message|>" + text, [TOOL])
    assert t.content == text and t.tool_calls == []


def test_reasoning_then_answer():
    t = parse_atem(" to=self<|message|>I need to output the invoice details in JSON<|eom|>"
                   "<|start|>assistant to=user<|message|>{\"amount\": 123.45}")
    assert t.reasoning == "I need to output the invoice details in JSON"
    assert t.content == '{"amount": 123.45}'


def test_markup_in_reasoning_is_not_a_call():
    t = parse_atem(" to=self<|message|>I could use " + CALL + " here<|eom|><|start|>assistant to=user<|message|>Hello!",
                   [TOOL])
    assert t.reasoning == "I could use " + CALL + " here"
    assert t.content == "Hello!" and t.tool_calls == []


def test_reasoning_then_call_and_parallel_calls():
    body = " to=self<|message|>think<|eom|><|start|>assistant to=special_function<|message|>" + CALL
    two = body + "<|eom|><|start|>assistant to=special_function<|message|>" + CALL.replace(">1<", ">2<")
    t = parse_atem(two, [TOOL])
    assert t.reasoning == "think"
    assert [c["arguments"] for c in t.tool_calls] == ['{"arg1":1}', '{"arg1":2}']
    assert len(parse_atem(two, [TOOL], parallel=False).tool_calls) == 0  # a second call is not taken


def test_string_parameters_are_taken_as_written():
    call = ('<atem:function_calls>\n<atem:invoke name="echo">\n<atem:parameter name="text"> two\n"lines" '
            '</atem:parameter>\n<atem:parameter name="n">3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>')
    t = parse_atem(" to=echo<|message|>" + call, [STR_TOOL])
    assert json.loads(t.tool_calls[0]["arguments"]) == {"text": ' two\n"lines" ', "n": 3}  # integer|null: JSON


def test_unknown_tool_or_parameter_or_bad_json_is_content():
    for text in (" to=nope<|message|>" + CALL.replace("special_function", "nope"),
                 " to=special_function<|message|>" + CALL.replace('"arg1"', '"other"'),
                 " to=special_function<|message|>" + CALL.replace(">1<", ">{oops<")):
        t = parse_atem(text, [TOOL])
        assert t.tool_calls == [] and t.content == text


def test_calls_not_parsed_without_tools():
    text = " to=special_function<|message|>" + CALL
    assert parse_atem(text, [TOOL], parse_calls=False).tool_calls == []
    assert parse_atem(text).content == text


def test_text_outside_the_protocol_is_content():
    for text in ("def f(): pass", " to=self<|message|>half<|eom|>tail"):
        assert parse_atem(text).content == text


def test_partial_holds_headers_and_calls():
    assert parse_atem(" to=us", partial=True).content == ""
    assert parse_atem(" to=user<|message|>Hel", partial=True).content == "Hel"
    assert parse_atem(" to=self<|message|>thi", partial=True).reasoning == "thi"
    got = parse_atem(" to=special_function<|message|><atem:function_calls>", [TOOL], partial=True)
    assert (got.content, got.tool_calls) == ("", [])
    assert parse_atem("def f(", partial=True).content == "def f("  # not the protocol: streamed as content
    assert parse_atem(" t", partial=True).content == ""  # could still be a header
    assert held_marker_suffix("abc<|eo") == len("<|eo")
    assert held_marker_suffix("abc") == 0
