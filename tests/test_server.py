"""The OpenAI-compatible server, driven over real HTTP by the official ``openai`` client.

Tiny random models over the real SmolLM2 tokenizer (so tool calls and JSON go through the
engine's grammar); every answer is checked against the engine called directly, so the
server adds nothing and loses nothing. One integration test uses the embedded model.
"""

from __future__ import annotations

import base64
import json
import logging
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
from conftest import running, terse_bias, tiny_engine, tiny_tool_engine

from snapkv_rag.compression import parse_compression
from snapkv_rag.server import ServerConfig

MAGIC = {
    "type": "function",
    "function": {
        "name": "magic_function",
        "description": "Applies a magic function.",
        "parameters": {"type": "object", "properties": {"input": {"type": "integer"}}, "required": ["input"]},
    },
}
LONG_QUESTION = " ".join(f"Fact {i}: the harbour light number {i} is green." for i in range(40)) + " Which light is green?"


@pytest.fixture(scope="module")
def engine(smollm_tokenizer):
    return tiny_tool_engine(smollm_tokenizer, bias=terse_bias(smollm_tokenizer))


@pytest.fixture(scope="module")
def embedder():
    from snapkv_rag.rag import Embedder

    return Embedder()


@pytest.fixture(scope="module")
def base_url(engine, embedder):
    # max_prompt_tokens: rolled prompts past the tiny model's 512-token context are read (the default bound is the context)
    with running(ServerConfig(engine, model_id="tiny", compression="snapkv:budget=64", embedder=embedder, max_prompt_tokens=20_000)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def ask(**kwargs):
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, **kwargs}


def test_reuse_segments_extension_stores_and_reuses_document_kv(client, engine):
    docs = [f"Document {i}: the harbour light number {i} is green and was repaired in {1990 + i}." * 2 for i in range(3)]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\n\n".join(docs) + "\n\nWhich light is green?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body={"reuse_segments": docs})
    assert first.model_extra["snapkv"]["segment_reuse"] == "blended"
    flipped = [messages[0], {"role": "user", "content": "\n\n".join(docs[::-1]) + "\n\nWhich light was repaired last?"}]
    again = client.chat.completions.create(model="tiny", messages=flipped, max_tokens=4, extra_body={"reuse_segments": docs, "recompute": 0})
    stats = again.model_extra["snapkv"]
    assert (stats["segment_hits"], stats["segment_misses"]) == (3, 0) and stats["reused_prompt_tokens"] > 0
    direct = engine.generate(flipped, max_new_tokens=4, compression="snapkv:budget=64", reuse_segments=docs, recompute=0)
    assert again.choices[0].message.content == direct.text
    # with recompute 0 only the policy's observation window (always fresh) is computed inside a document
    assert stats["recomputed_prompt_tokens"] == direct.stats.recomputed_prompt_tokens <= direct.stats.compression["window_size"]
    for body, param in (
        ({"reuse_segments": "text"}, "reuse_segments"),
        ({"reuse_segments": [1]}, "reuse_segments"),
        ({"reuse_segments": docs, "recompute": 2}, "recompute"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=body)
        assert err.value.body["param"] == param


def test_keep_texts_extension_keeps_its_texts_under_the_servers_compression(client, engine):
    from snapkv_rag.compression import recording_kept_indices

    messages = [{"role": "user", "content": LONG_QUESTION}]
    label = "Fact 7: the harbour light number 7 is green."
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body={"keep_texts": [label]})
    with recording_kept_indices() as kept:
        direct = engine.generate(messages, max_new_tokens=4, compression="snapkv:budget=64", keep_texts=[label])
    assert response.choices[0].message.content == direct.text
    assert response.model_extra["snapkv"]["protected_prompt_tokens"] == direct.stats.protected_prompt_tokens > 0
    plain = engine.generate(messages, max_new_tokens=4, compression="snapkv:budget=64")
    assert plain.stats.protected_prompt_tokens == 0
    assert kept[-1].share().sum().item() == pytest.approx(64) and plain.stats.kept_tokens_per_layer[0] == 64
    for body in ({"keep_texts": "text"}, {"keep_texts": ["not in this prompt"]}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=body)
        assert err.value.body["param"] == "keep_texts"


def test_chat_answer_is_the_engines_own_with_the_servers_compression(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG_QUESTION}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    direct = engine.generate(messages, max_new_tokens=12, compression="snapkv:budget=64")
    choice = response.choices[0]
    assert choice.message.content == direct.text and choice.finish_reason == direct.finish_reason
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (direct.usage.prompt_tokens, direct.usage.completion_tokens)
    stats = response.model_extra["snapkv"]
    assert stats["compression"]["method"] == "snapkv" and stats["kept_tokens_per_layer"][0] == 64 < direct.usage.prompt_tokens
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion" and response.model == "tiny"
    # The request's own policy wins over the server's default.
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, extra_body={"compression": "full"})
    assert full.model_extra["snapkv"]["kept_tokens_per_layer"][0] == direct.usage.prompt_tokens
    assert full.choices[0].message.content == engine.generate(messages, max_new_tokens=12).text


def test_a_request_stores_its_kept_entries_in_fewer_bits(client, engine):
    messages = [{"role": "user", "content": LONG_QUESTION}]
    wide = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_body={"compression": "snapkv:budget=200"})
    narrow = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_body={"compression": "snapkv:budget=200,kv_bits=4"})
    stats, wide_stats = narrow.model_extra["snapkv"], wide.model_extra["snapkv"]
    assert stats["compression"]["kv_bits"] == 4 and stats["kept_tokens_per_layer"] == wide_stats["kept_tokens_per_layer"]
    assert stats["prompt_kv_bytes_kept"] < wide_stats["prompt_kv_bytes_kept"]
    direct = engine.generate(messages, max_new_tokens=8, compression="snapkv:budget=200,kv_bits=4")
    assert narrow.choices[0].message.content == direct.text and stats["prompt_kv_bytes_kept"] == direct.stats.prompt_kv_bytes_kept


def test_streamed_chat_reassembles_to_the_plain_answer(client):
    plain = client.chat.completions.create(**ask(max_tokens=16, temperature=0.9, seed=3))
    chunks = list(client.chat.completions.create(**ask(max_tokens=16, temperature=0.9, seed=3), stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1
    # the engine's stats: on the finish chunk, and on the last chunk (the usage one), as docs/server.md says
    ending = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert ending.model_extra["snapkv"]["kept_tokens_per_layer"] == chunks[-1].model_extra["snapkv"]["kept_tokens_per_layer"]


def test_tool_calls_plain_and_streamed(client, engine):
    messages = [{"role": "user", "content": "What is magic_function(3)?"}]
    response = client.chat.completions.create(model="tiny", messages=messages, tools=[MAGIC], tool_choice="required", max_tokens=40)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    direct = engine.generate(messages, tools=[MAGIC], tool_choice="required", max_new_tokens=40, compression="snapkv:budget=64")
    assert (call.function.name, json.loads(call.function.arguments)) == (direct.tool_calls[0].name, direct.tool_calls[0].arguments)
    jsonschema.validate(json.loads(call.function.arguments), MAGIC["function"]["parameters"])
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, tools=[MAGIC], tool_choice="required", max_tokens=40, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(streamed) == [0]
    assert streamed[0]["id"].startswith("call_") and streamed[0]["name"] == "magic_function"
    assert json.loads(streamed[0]["arguments"]) == json.loads(call.function.arguments)
    # The tool's result goes back as a tool message; the model then answers (or calls again) validly.
    follow = messages + [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "22"}]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=[MAGIC], max_tokens=12)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}}, "required": ["city", "rank"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    response = client.chat.completions.create(**ask(max_tokens=60), response_format=fmt)
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_legacy_completions_are_raw_text(client, engine):
    response = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10)
    direct = engine.generate("Once upon a time", chat=False, max_new_tokens=10, compression="snapkv:budget=64")
    assert response.choices[0].text == direct.text and response.object == "text_completion"
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, stream=True))
    assert streamed == direct.text


def test_embeddings_match_the_rag_embedder(client, embedder):
    texts = ["the first ferry leaves at 6:40", "tides and harbour lights"]
    expected = np.array(embedder.embed(texts))
    for encoding in ("float", "base64"):
        response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format=encoding)
        got = response.data
        if encoding == "base64":  # the client hands base64 back undecoded when asked for it explicitly
            got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in got]
        else:
            got = [np.array(d.embedding) for d in got]
        assert np.allclose(np.stack(got), expected, atol=1e-6)
    assert response.usage.prompt_tokens > 0
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input="one text")  # the client's own default: base64
    assert np.allclose(np.array(default.data[0].embedding), embedder.embed(["one text"])[0], atol=1e-6)


def test_a_prompt_past_the_window_answers_when_its_compression_rolls(client, engine):
    messages = [{"role": "user", "content": "word " * 3000 + "How many words?"}]
    rolled = {"compression": "snapkv:budget=64,window=16,rolling=128"}
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body=rolled)
    assert reply.usage.prompt_tokens > engine.context_length
    uncapped = client.chat.completions.create(model="tiny", messages=messages, extra_body=rolled)  # the room left is the rolled bound's
    assert uncapped.usage.completion_tokens >= 1
    # the server's own sparse policy names no rolling=: the one rule reads the prompt rolled all the same
    for max_tokens in (4, None):
        by_rule = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens)
        assert by_rule.usage.prompt_tokens > engine.context_length and by_rule.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="rolling="):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body={"compression": "full"})


def test_nan_sampling_and_repeated_settings_get_errors_that_say_so(base_url):
    for body, param, says in (
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature", "finite"),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "top_p", "finite"),
        (json.dumps(ask(compression="snapkv:budget=64,budget=32")), "compression", "given twice"),
    ):
        response = httpx.post(base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and says in error["message"], error


def test_models_lists_what_is_served(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "all-MiniLM-L6-v2"]


BAD_REQUESTS = [
    (ask(n=2), 400, "n", "unsupported_parameter"),
    (ask(logprobs=True), 400, "logprobs", "unsupported_parameter"),
    (ask(presence_penalty=0.5), 400, "presence_penalty", "unsupported_parameter"),
    (ask(frobnicate=1), 400, "frobnicate", "unrecognized_argument"),
    (ask(model="gpt-4o"), 404, "model", "model_not_found"),
    (ask(compression="snapkv:budget=-3"), 400, "compression", None),
    (ask(compression="zip:budget=3"), 400, "compression", None),
    (ask(compression="snapkv:budget=64,kv_bits=2"), 400, "compression", None),
    (ask(max_tokens=0), 400, "max_tokens", None),
    (ask(max_tokens=100_000), 400, "messages", "context_length_exceeded"),
    (ask(messages=[{"role": "user", "content": "word " * 3000}], compression="full"), 400, "messages", "context_length_exceeded"),
    (ask(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages", "unsupported_parameter"),
    (ask(messages=[{"role": "user", "content": "\ud83d hi"}]), 400, None, None),  # a lone surrogate escape
    (ask(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": -1}]), 400, "messages", None),
    (
        ask(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": [1], "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            ]
        ),
        400,
        "messages",
        None,
    ),
    (ask(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": [], "content": "22"}]), 400, "messages", None),
    (ask(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "22"}]), 400, "messages", None),
    (ask(messages=[{"role": "user", "content": "hi", "name": 5}]), 400, "messages", None),
    (ask(messages=[]), 400, "messages", None),
    (ask(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", None),
    (ask(messages=[{"role": "user", "content": "   "}]), 400, "messages", None),
    (ask(temperature="hot"), 400, "temperature", None),
    (ask(temperature=-1), 400, "temperature", None),
    (ask(temperature=5), 400, "temperature", None),
    (ask(top_p=0), 400, "top_p", None),
    (ask(seed=1.5), 400, "seed", None),
    (ask(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
    (ask(stream_options={"include_usage": True}), 400, "stream_options", None),
    (ask(tools=[{"type": "function", "function": {"parameters": {}}}]), 400, "tools", "structured_output_error"),
    (ask(tool_choice="required"), 400, "tool_choice", None),
    (ask(tools=[MAGIC], tool_choice={"type": "function", "function": {"name": "other"}}), 400, "tool_choice", "structured_output_error"),
    (ask(response_format={"type": "xml"}), 400, "response_format", "structured_output_error"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model", None),
    ([1, 2, 3], 400, None, None),
]


@pytest.mark.parametrize("body, status, param, code", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_get_one_clear_error_and_the_server_carries_on(base_url, body, status, param, code):
    # json.dumps escapes to ASCII, so a lone surrogate travels as "\ud83d", as clients send it
    response = httpx.post(base_url + "/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["param"] == param and error["code"] == code
    assert httpx.post(base_url + "/v1/chat/completions", json=ask(max_tokens=2), timeout=60).status_code == 200


def test_malformed_bodies_and_routes(base_url):
    for raw in (b"{not json", b"\xff\xfe{", b""):
        response = httpx.post(base_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        message = response.json()["error"]["message"]
        assert response.status_code == 400 and ("not valid JSON" in message or "not UTF-8" in message)
    assert httpx.get(base_url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(base_url + "/v1/chat/completions").status_code == 405
    bad_embedding = httpx.post(base_url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "word " * 600})
    assert bad_embedding.status_code == 400 and bad_embedding.json()["error"]["code"] == "input_too_long"
    assert httpx.post(base_url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": [""]}).status_code == 400
    assert httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]}).json()["error"]["param"] == "prompt"
    too_long = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "word " * 3000, "compression": "full"}).json()["error"]
    assert (too_long["param"], too_long["code"]) == ("prompt", "context_length_exceeded")
    deep = b'{"model": "tiny", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert httpx.post(base_url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}).status_code == 400
    huge = httpx.post(base_url + "/v1/chat/completions", content=b"x" * (9 << 20))
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert httpx.get(base_url + "/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(base_url + "/v1/models/gpt-4o").json()["error"]["code"] == "model_not_found"
    health = httpx.get(base_url + "/health").json()
    assert health["status"] == "ok" and health["compression"] == parse_compression("snapkv:budget=64").spec()
    assert health["compiled_decode"] == "compile_decode is off"


def test_a_server_fault_is_still_one_openai_shaped_error(base_url, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "astream", broken)
    response = httpx.post(base_url + "/v1/chat/completions", json=ask(), timeout=60)
    error = response.json()["error"]
    assert response.status_code == 500 and error["type"] == "server_error" and "boom" not in error["message"]  # the text stays in the log
    assert error["code"].startswith("error-") and error["code"] in error["message"]
    monkeypatch.undo()
    assert httpx.post(base_url + "/v1/chat/completions", json=ask(max_tokens=2), timeout=60).status_code == 200


def test_cors_only_when_origins_are_allowed(engine, base_url):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in httpx.options(base_url + "/v1/chat/completions", headers=preflight).headers
    with running(ServerConfig(engine, model_id="tiny", allow_origins=("http://localhost:3000",))) as url:
        response = httpx.options(url + "/v1/chat/completions", headers=preflight)
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_a_call_cut_short_mid_stream_ends_with_an_error_event(base_url):
    nested = {
        "type": "object",
        "properties": {"where": {"type": "object", "properties": {"name": {"type": "string"}, "lat": {"type": "number"}}, "required": ["name", "lat"]}},
        "required": ["where"],
    }
    tool = {"type": "function", "function": {"name": "locate", "parameters": nested}}
    body = ask(tools=[tool], tool_choice="required", max_tokens=4, stream=True)
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    last = json.loads(events[-1])
    message = last["error"]["message"]
    assert "raise max_tokens" in message and "max_new_tokens" not in message and "[DONE]" not in events  # the name the client sent
    plain = httpx.post(base_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "structured_output_error"


def test_api_key_is_required_when_set(engine):
    with running(ServerConfig(engine, model_id="tiny", api_key="s3cret")) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
                response = httpx.request(method, url + path, json=ask(), headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(**ask(max_tokens=3)).choices[0].message.content is not None
        # the key is checked first for every /v1/ path (what exists is not told to strangers); /health stays open
        assert httpx.get(url + "/v1/embeddings").status_code == 401
        assert httpx.get(url + "/v1/embeddings", headers={"Authorization": "Bearer s3cret"}).status_code == 405
        assert httpx.post(url + "/v1/embeddings", json={"model": "x", "input": "y"}, headers={"Authorization": "Bearer s3cret"}).status_code == 404
        assert httpx.get(url + "/health").status_code == 200


def test_without_max_tokens_a_reply_gets_the_servers_cap_or_the_room_left(tokenizer):
    plain = tiny_engine("llama", tokenizer)  # no EOS bias: it writes until a limit stops it
    with running(ServerConfig(plain, model_id="tiny", default_max_tokens=5, compression=None)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        capped = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}], temperature=1.0, seed=4)
        assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (5, "length")
        # A prompt that leaves 3 tokens of the 512-token context: the reply gets those 3.
        words = ["hello"]
        while plain.count_tokens([{"role": "user", "content": " ".join(words)}]) < plain.context_length - 3:
            words.append("hello")
        messages = [{"role": "user", "content": " ".join(words)}]
        room = plain.context_length - plain.count_tokens(messages)
        assert 1 <= room <= 3
        tight = client.chat.completions.create(model="tiny", messages=messages, temperature=1.0, seed=4)
        assert tight.usage.completion_tokens <= room and tight.usage.prompt_tokens + tight.usage.completion_tokens <= plain.context_length
        with pytest.raises(openai.BadRequestError, match="context"):
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=room + 1)


def test_a_client_that_goes_away_stops_its_generation(tokenizer, caplog):
    slow = tiny_engine("llama", tokenizer)
    steps = []

    def count(_module, _args):
        steps.append(time.monotonic())
        time.sleep(0.02)

    slow.model.register_forward_pre_hook(count)
    server_errors: list[logging.LogRecord] = []
    catcher = logging.Handler(logging.ERROR)
    catcher.emit = server_errors.append
    with running(ServerConfig(slow, model_id="slow", compression=None)) as url, caplog.at_level(logging.INFO, logger="snapkv_rag.server"):
        logging.getLogger("uvicorn.error").addHandler(catcher)  # after uvicorn configured its loggers
        body = {
            "model": "slow",
            "messages": [{"role": "user", "content": "Hello world"}],
            "max_tokens": 400,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "temperature": 1.0, "seed": 0}, timeout=60) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 6:
                    break
        time.sleep(1.0)
        seen = len(steps)
        time.sleep(0.5)
        assert len(steps) == seen < 100  # stopped, far short of 400 steps
        assert any("ended early" in r.getMessage() for r in caplog.records)
        # The same for a plain request whose client gives up waiting.
        plain = {**body, "stream": False, "stream_options": None, "temperature": 1.0, "seed": 1}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=plain, timeout=0.6)
        time.sleep(1.0)
        seen_plain = len(steps)
        time.sleep(0.5)
        assert len(steps) == seen_plain < seen + 100
        assert any("client disconnected" in r.getMessage() for r in caplog.records)
        # The engine is free for the next request.
        response = httpx.post(url + "/v1/chat/completions", json={**plain, "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
    logging.getLogger("uvicorn.error").removeHandler(catcher)
    assert not server_errors, [r.getMessage() for r in server_errors]  # a client leaving is not a server error


def test_concurrent_requests_each_get_their_own_answer(base_url, engine):
    import asyncio

    prompts = [f"Count to {n}." for n in (3, 5, 7, 9)]

    async def main():
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*[client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=10) for p in prompts])

    responses = asyncio.run(main())
    for prompt, response in zip(prompts, responses):
        assert response.choices[0].message.content == engine.generate(prompt, max_new_tokens=10, compression="snapkv:budget=64").text


def test_serve_cli_checks_its_settings_before_loading_a_model(capsys):
    from snapkv_rag.cli import main
    from snapkv_rag.server.config import served_model_name

    assert main(["serve", "--compression", "zip:budget=3"]) == 2
    assert "compression" in capsys.readouterr().err
    assert main(["serve", "--default-max-tokens", "0"]) == 2
    assert main(["serve", "--max-batch-size", "0"]) == 2
    assert "--max-batch-size" in capsys.readouterr().err
    assert main(["serve", "--prefill-chunk-tokens", "8"]) == 2
    assert "--prefill-chunk-tokens" in capsys.readouterr().err
    assert served_model_name("default") == "SmolLM2-135M-Instruct"
    assert served_model_name("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"


@pytest.mark.integration
def test_embedded_model_answers_through_the_openai_client(embedded_engine):
    with running(ServerConfig(embedded_engine, model_id="SmolLM2-135M-Instruct", aliases=("default",))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        response = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20)
        assert "Paris" in response.choices[0].message.content
        call = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the value of magic_function(3)?"}],
            tools=[MAGIC],
            tool_choice="required",
        )
        assert call.choices[0].message.tool_calls[0].function.name == "magic_function"


# ----------------------------------------------------------------------------- load: back-pressure, metrics, vLLM fields
def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text exposition (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


def test_embedding_requests_are_counted_in_metrics(base_url):
    before = httpx.get(base_url + "/metrics").text
    ok = metric(before, "snapkv_requests_total", endpoint="embeddings", status="200")
    wrong_model = metric(before, "snapkv_requests_total", endpoint="embeddings", status="404")
    assert httpx.post(base_url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hello"}).status_code == 200
    assert httpx.post(base_url + "/v1/embeddings", json={"model": "nope", "input": "hello"}).status_code == 404
    after = httpx.get(base_url + "/metrics").text
    assert metric(after, "snapkv_requests_total", endpoint="embeddings", status="200") == ok + 1
    assert metric(after, "snapkv_requests_total", endpoint="embeddings", status="404") == wrong_model + 1


def test_metrics_are_scraped_in_prometheus_format(base_url):
    before = httpx.get(base_url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    chat = metric(before.text, "snapkv_requests_total", endpoint="chat", status="200")
    bad = metric(before.text, "snapkv_requests_total", endpoint="chat", status="400")
    completion = metric(before.text, "snapkv_completion_tokens_total")
    ttft = metric(before.text, "snapkv_time_to_first_token_seconds_count")
    assert httpx.post(base_url + "/v1/chat/completions", json=ask(max_tokens=5, ignore_eos=True)).status_code == 200
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=ask(max_tokens=5, ignore_eos=True, stream=True)) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in "".join(streamed.iter_text())
    assert httpx.post(base_url + "/v1/chat/completions", json=ask(temperature=-1)).status_code == 400
    after = httpx.get(base_url + "/metrics").text
    assert metric(after, "snapkv_requests_total", endpoint="chat", status="200") == chat + 2
    assert metric(after, "snapkv_requests_total", endpoint="chat", status="400") == bad + 1
    assert metric(after, "snapkv_completion_tokens_total") == completion + 10
    assert metric(after, "snapkv_time_to_first_token_seconds_count") == ttft + 2
    assert metric(after, "snapkv_inter_token_latency_seconds_count") >= 8  # 4 gaps in each 5-token answer
    assert metric(after, "snapkv_requests_in_flight") == 0
    assert metric(after, "snapkv_prefix_cache_bytes") > 0 and 0 <= metric(after, "snapkv_prefix_cache_hit_ratio") <= 1
    for name in ("snapkv_chunk_kv_bytes", "snapkv_chunk_kv_hit_ratio", "snapkv_prompt_kv_bytes_kept_count", "snapkv_requests_rejected_total"):
        assert f"\n{name}" in after


def test_a_full_queue_answers_429_with_retry_after_and_recovers(engine):
    with running(ServerConfig(engine, model_id="tiny", max_queue=1, compression=None)) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json=ask(max_tokens=1500, ignore_eos=True, stream=True), timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: dropping the iterator closes the response, which frees the place
            next(lines)  # the first request holds the only place while it streams
            busy = httpx.post(url + "/v1/chat/completions", json=ask(max_tokens=3), timeout=60)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full" and busy.json()["error"]["type"] == "rate_limit_error"
        # leaving the stream frees the place: the next request is served
        deadline = time.monotonic() + 30
        while (r := httpx.post(url + "/v1/chat/completions", json=ask(max_tokens=3), timeout=60)).status_code == 429:
            assert time.monotonic() < deadline, "the place of a closed stream was never released"
            time.sleep(0.1)
        assert r.status_code == 200
        scraped = httpx.get(url + "/metrics").text
        assert metric(scraped, "snapkv_requests_rejected_total") >= 1 and metric(scraped, "snapkv_requests_in_flight") == 0


def test_vllm_ignore_eos_and_min_tokens_are_honoured(tokenizer):
    from conftest import tiny_engine as make

    eager = make("llama", tokenizer)
    eos = eager.tokenizer.eos_token_id
    bias = torch.zeros(len(tokenizer))
    bias[eos] = 50.0  # this model ends every reply at once
    eager.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + bias.to(out.dtype))
    with running(ServerConfig(eager, model_id="tiny", compression=None)) as url:

        def tokens(**extra):
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, **extra}
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["usage"]["completion_tokens"], response.json()["choices"][0]["finish_reason"]

        assert tokens() == (1, "stop")  # the EOS token itself counts, as OpenAI's usage does
        assert tokens(min_tokens=7) == (8, "stop")  # EOS is held back for 7 tokens, then chosen at once
        assert tokens(ignore_eos=True) == (12, "length")
        for body, param in (({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20}, "min_tokens"), ({"ignore_eos": "yes"}, "ignore_eos")):
            response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 12, **body}, timeout=60)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_prompt_lookup_drafts_are_a_request_field_with_stats_and_metrics(client, base_url):
    prompt = LONG_QUESTION + " Repeat the facts."
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True})
    drafted = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True, "prompt_lookup_num_tokens": 4})
    assert drafted.choices[0].text == plain.choices[0].text
    drafts = drafted.model_extra["snapkv"]["drafts"]
    assert drafts["prompt_lookup_num_tokens"] == 4 and "draft_forwards" in drafts
    assert plain.model_extra["snapkv"]["drafts"] is None
    metrics = httpx.get(base_url + "/metrics", timeout=30).text
    drafted_total = [line for line in metrics.splitlines() if line.startswith("snapkv_draft_tokens_total")]
    assert drafted_total and float(drafted_total[0].split()[-1]) == drafts["drafted_tokens"]
    for bad in (-1, 65, "4", True):
        response = httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "prompt_lookup_num_tokens": bad}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_lookup_num_tokens", response.text
