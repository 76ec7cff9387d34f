"""The OpenAI face's pure parts: a request checked and planned as generations (translate.py),
token ids turned into text while they stream (text.py), chat messages through a template
(chat.py), errors in OpenAI's shape (errors.py)."""
from __future__ import annotations

import pytest

from tgw.broker.faces.openai import translate
from tgw.broker.faces.openai.chat import ChatTemplate, messages_of
from tgw.broker.faces.openai.errors import OpenAiError, from_tgw
from tgw.broker.faces.openai.text import TextStream
from tgw.shm.byte_tokenizer import Tokenizer
from tgw.shm.errors import Code, fail

TOK = Tokenizer()


def refused(body: dict, chat: bool = False) -> OpenAiError:
    with pytest.raises(OpenAiError) as e:
        if chat:
            translate.chat_plan(body, TOK, "x")
        else:
            translate.completion_plan(body, TOK)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_a_completion_is_planned_as_one_generation_per_prompt_and_n():
    plan = translate.completion_plan({"model": "m", "prompt": ["ab", "c"], "n": 2, "seed": 5, "temperature": 0.5,
                                      "top_p": 0.9, "top_k": 3, "stop": "b", "max_tokens": 7}, TOK)
    assert plan.prompts == [[97, 98], [99]] and len(plan.params) == 4 and plan.prompt_tokens == 3
    assert [p.sampling.seed for p in plan.params] == [5, 6, 5, 6]
    assert [plan.prompt_of(i) for i in range(4)] == [[97, 98], [97, 98], [99], [99]]
    s = plan.params[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop_sequences, plan.params[0].max_outputs) == (0.5, 0.9, 3, [[98]], 7)
    default = translate.completion_plan({"model": "m", "prompt": [1, 2, 3]}, TOK)
    assert default.params[0].max_outputs == 16 and default.params[0].sampling.temperature == 0.0
    assert default.id.startswith("cmpl-") and not default.stream


def test_chat_takes_either_limit_and_opens_with_the_role():
    plan = translate.chat_plan({"model": "m", "messages": [], "max_completion_tokens": 9, "stream": True,
                                "stream_options": {"include_usage": True}}, TOK, "hi")
    assert plan.params[0].max_outputs == 9 and plan.include_usage and plan.id.startswith("chatcmpl-")
    assert translate.chat_plan({"model": "m", "messages": []}, TOK, "hi").params[0].max_outputs is None
    first = translate.chunk(plan, 1, 0, "", None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["usage"] is None
    assert translate.chunk(plan, 1, 0, None, "stop")["choices"][0]["delta"] == {}
    assert refused({"model": "m", "messages": [], "max_tokens": 3, "max_completion_tokens": 4}, chat=True).param \
        == "max_tokens"


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"suffix": "x"}, "suffix"), ({"bogus": 1}, "bogus"), ({"n": 17}, "n"), ({"n": 0}, "n"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": True}, "top_p"),
    ({"stop": ["a"] * 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 3}, "stop"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": ""}, "prompt"),
    ({"prompt": "a\0b"}, "prompt"), ({"prompt": {"x": 1}}, "prompt"), ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 1.5}, "seed"), ({"user": 3}, "user"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": [[1 << 40]]}, "prompt"),
])
def test_what_is_not_served_is_refused_by_name(body, param):
    assert refused({"model": "m", "prompt": "x", **body}).param == param


def test_defaults_of_unserved_parameters_pass():
    translate.completion_plan({"model": "m", "prompt": "x", "logprobs": None, "echo": False, "best_of": 1,
                               "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}, TOK)
    translate.chat_plan({"model": "m", "messages": [], "tools": [], "tool_choice": "none",
                         "response_format": {"type": "text"}, "logprobs": False}, TOK, "x")
    assert refused({"model": "m", "messages": [], "response_format": {"type": "json_object"}}, chat=True).param \
        == "response_format"
    assert refused({"model": "m", "messages": [], "tools": [{"type": "function"}]}, chat=True).param == "tools"


def test_usage_and_finish_reasons():
    assert translate.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert [translate.finish_reason(r) for r in ("stop_token", "stop_sequence", "done", "max_outputs",
                                                  "max_length")] == ["stop", "stop", "stop", "length", "length"]


def test_text_streams_whole_characters_and_stops_before_a_stop_string():
    t = TextStream(TOK, [])
    e_acute = list("é".encode())
    assert [t.feed([104]), t.feed(e_acute[:1]), t.feed(e_acute[1:]), t.finish()] == ["h", "", "é", ""]
    t = TextStream(TOK, ["END", "xy"])
    pieces = [t.feed(list(s.encode())) for s in ("ab", "cE", "N", "q E", "ND tail")]
    assert pieces == ["ab", "c", "", "ENq ", ""] and t.stopped and t.text == "abcENq "
    t = TextStream(TOK, ["zz"])
    assert (t.feed(list(b"az")), t.finish(), t.stopped) == ("a", "z", False)


def test_chat_messages_through_a_template():
    msgs = messages_of([{"role": "system", "content": "be brief"},
                        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]}])
    assert ChatTemplate(None, "m").render(msgs) == "system: be brief\nuser: hi you\nassistant:"
    hf = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    assert ChatTemplate(hf, "m").render(msgs) == "<|system|>be brief<|user|>hi you<|assistant|>"
    with pytest.raises(OpenAiError, match="refused"):
        ChatTemplate("{{ raise_exception('no system messages') }}", "m").render(msgs)
    with pytest.raises(OpenAiError):   # the sandbox: no reaching into Python's internals
        ChatTemplate("{{ messages.__class__.__mro__ }}", "m").render(msgs)
    with pytest.raises(ValueError, match="chat_template"):
        ChatTemplate("{% for %}", "m")
    for bad, param in (([], "messages"), ([{"role": "tool", "content": "x"}], "messages[0].role"),
                       ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
                       ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls")):
        with pytest.raises(OpenAiError) as e:
            messages_of(bad)
        assert e.value.param == param


def test_tgw_errors_keep_their_status_in_openai_shape():
    err = from_tgw(fail(Code.OVERLOADED, "queue full"))
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    assert from_tgw(fail(Code.MODEL_NOT_FOUND, "x")).status == 404
    assert from_tgw(fail(Code.INTERNAL, "x")).status == 500
    assert from_tgw(fail(Code.INVALID_ARGUMENT, "x", parameter="top_p")).param == "top_p"


def test_the_config_names_a_bad_tokenizer_or_template_by_its_key():
    from pydantic import ValidationError

    from tgw.broker.config.schema_models import ModelDecl, tokenizer_class
    from tgw.shm.byte_tokenizer import Tokenizer
    gen = {"state": [{"name": "kv", "dtype": "float32", "shape": [2]}], "max_sequences": 2, "tokenizer": "bytes"}
    base = dict(name="g", versions=[{"version": "1", "handler": "a.b:C"}],
                inputs=[{"name": "p", "dtype": "int64", "shape": [-1]}],
                outputs=[{"name": "t", "dtype": "int64", "shape": []}], generator=gen)
    assert ModelDecl(**base, options={"chat_template": "{{ messages }}"}).generator.tokenizer == "bytes"
    named = ModelDecl(**{**base, "generator": {**gen, "tokenizer": "tgw.shm.byte_tokenizer:Tokenizer"}})
    assert tokenizer_class(named.generator.tokenizer) is Tokenizer is tokenizer_class("bytes")
    for change, words in (({"generator": {**gen, "tokenizer": "no.such.module:T"}}, "cannot be imported"),
                          ({"generator": {**gen, "tokenizer": "json:loads"}}, "not a class with encode"),
                          ({"generator": {**gen, "tokenizer": "sentencepiece"}}, "package.module:Class"),
                          ({"inputs": [{"name": "p", "dtype": "float32", "shape": [-1]}]}, "integer token ids"),
                          ({"options": {"chat_template": "{% for %}"}}, "options.chat_template")):
        with pytest.raises(ValidationError, match=words) as e:
            ModelDecl(**{**base, **change})
        assert "tokenizer" in str(e.value) or "chat_template" in str(e.value)


def test_the_models_cap_on_outputs_in_openai_words():
    from tgw.broker.faces.openai.face import OpenAiFace
    plan = translate.completion_plan({"model": "m", "prompt": "x"}, TOK)
    OpenAiFace.capped(plan, 8)   # OpenAI's default of 16 lowered to the model's cap
    assert plan.params[0].max_outputs == 8
    plan = translate.chat_plan({"model": "m", "messages": [], "max_completion_tokens": 9}, TOK, "x")
    with pytest.raises(OpenAiError) as e:
        OpenAiFace.capped(plan, 8)
    assert e.value.param == "max_completion_tokens" and "at most 8" in e.value.message


def test_a_pieces_event_rendered_once_is_the_chunk():
    import orjson
    for chat in (False, True):
        plan = translate.chat_plan({"model": "m", "messages": []}, TOK, "x") if chat else \
            translate.completion_plan({"model": "m", "prompt": "x"}, TOK)
        head, tail = translate.chunk_frame(plan, 7, 1)
        piece = 'a "quoted"\n\u00e9'
        assert head + orjson.dumps(piece) + tail == \
            b"data: " + orjson.dumps(translate.chunk(plan, 7, 1, piece, None)) + b"\n\n"
