"""The API on the shipped micro model through a real `muser serve` process and the real
`openai` client: chat and completions, streaming, logprobs, stop, seeds, named sessions,
metrics, and every bad input answered with a 4xx naming the field while the server keeps serving."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from .conftest import API_KEY

USER = [{"role": "user", "content": "def add(a, b):"}]


def _post(s, path, body, key=API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(s.base_url + path, content=data, headers={"Content-Type": "application/json", **headers},
                      timeout=120, **kw)


def test_models_and_health(micro):
    c = micro.client()
    ids = [m.id for m in c.models.list().data]
    assert ids == [micro.model] == ["muse-glimmer-micro-q8_0"]
    h = httpx.get(micro.root + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["slots"] == 4
    line = next(x for x in micro.proc.log if "listening on" in x)
    assert "4 slots, context " in line and "device cpu, lane exact, threads 1)" in line  # --threads 1 reached the engine


def test_chat_non_streaming_and_streaming_agree(micro):
    c = micro.client()
    r = c.chat.completions.create(model=micro.model, messages=USER, max_tokens=6, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.role == "assistant" and ch.message.content
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    chunks = list(c.chat.completions.create(model=micro.model, messages=USER, max_completion_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(k.choices[0].delta.content or "" for k in chunks if k.choices)
    assert text == ch.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [k.choices[0].finish_reason for k in chunks if k.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_sse_ends_with_done(micro):
    body = {"model": micro.model, "prompt": "import os", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", micro.base_url + "/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_completions_logprobs(micro):
    c = micro.client()
    r = c.completions.create(model=micro.model, prompt="for i in range(", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(v)  # greedy: the pick is the most likely token
    assert lp.text_offset[0] == 0


def test_chat_logprobs_shape(micro):
    c = micro.client()
    r = c.chat.completions.create(model=micro.model, messages=USER, max_tokens=3, temperature=0,
                                  logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert math.isfinite(e.logprob)


def test_stop_string(micro):
    c = micro.client()
    full = c.completions.create(model=micro.model, prompt="x = [1, 2,", max_tokens=8, temperature=0).choices[0].text
    assert len(full) > 2
    stop = full[1:3]
    got = c.completions.create(model=micro.model, prompt="x = [1, 2,", max_tokens=8, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(micro):
    c = micro.client()
    kw = dict(model=micro.model, prompt="class A:", max_tokens=5, temperature=1.0, top_p=1.0,
              extra_body={"top_k": 0, "min_p": 0.0})
    a = c.completions.create(seed=1234, **kw).choices[0].text
    b = c.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


def test_named_session_reuses_kv(micro):
    c = micro.client()
    h = {"x-session-id": "conv-1"}
    first = c.chat.completions.create(model=micro.model, messages=USER, max_tokens=3, temperature=0, extra_headers=h)
    turn2 = USER + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "again"}]
    cold = c.chat.completions.create(model=micro.model, messages=turn2, max_tokens=3, temperature=0)
    warm = c.chat.completions.create(model=micro.model, messages=turn2, max_tokens=3, temperature=0, extra_headers=h)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    listed = httpx.get(micro.base_url + "/sessions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert [s["id"] for s in listed["data"]] == ["conv-1"]
    d = httpx.delete(micro.base_url + "/sessions/conv-1", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert d.status_code == 200
    d = httpx.delete(micro.base_url + "/sessions/conv-1", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert d.status_code == 404


BAD = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"seed": -1}, "seed"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop": ["a", ""]}, "stop"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # the micro template has no tools
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),  # over the context
]


@pytest.mark.parametrize("patch,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400_naming_them(micro, patch, param):
    body = {"model": micro.model, "messages": USER, "max_tokens": 2, **patch}
    r = _post(micro, "/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_nan_body_and_bad_json_and_wrong_key_and_model(micro):
    r = _post(micro, "/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
                                         '"temperature": NaN}' % micro.model)
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]
    assert _post(micro, "/chat/completions", b"{not json").status_code == 400
    assert _post(micro, "/chat/completions", {"model": micro.model, "messages": USER}, key="wrong").status_code == 401
    assert _post(micro, "/chat/completions", {"model": micro.model, "messages": USER}, key=None).status_code == 401
    r = _post(micro, "/chat/completions", {"model": "gpt-4", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _post(micro, "/chat/completions", {"model": micro.model, "messages": USER}, headers={"x-session-id": "../x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-id"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=micro.base_url, api_key="nope", max_retries=0).models.list()


def test_unknown_route_and_method_are_json_errors(micro):
    r = httpx.get(micro.base_url + "/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(micro.base_url + "/chat/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_huge_body_is_413(micro):
    r = _post(micro, "/completions", {"model": micro.model, "prompt": "x" * (5 << 20)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_metrics_and_still_serving(micro):
    c = micro.client()
    assert c.completions.create(model=micro.model, prompt="pass", max_tokens=2, temperature=0).choices[0].text is not None
    text = httpx.get(micro.root + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    for name in ("muser_queue_depth", "muser_slots_busy", "muser_slots_total 4.0",
                 "muser_time_to_first_token_seconds_bucket", "muser_inter_token_latency_seconds_bucket",
                 "muser_completion_tokens_total", 'muser_requests_total{endpoint="completions",status="200"}'):
        assert name in text, name
    assert "spec" not in text  # no drafter here, so no acceptance series
    assert micro.alive()
