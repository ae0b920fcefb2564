"""Anthropic's Messages API (``/v1/messages``) through Anthropic's own client: text, tool use
and tool results, streaming events, token counting, errors in Anthropic's shape. The text is
the chat pipeline's: the same as ``/v1/chat/completions`` for the same greedy request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llamabatch.server.anthropic import to_chat_body

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import serve  # noqa: E402 (after the skips: it needs the server extra)

from llamabatch.server import create_app  # noqa: E402

KEY = "sk-anthropic"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def base_url(tiny_qwen_llm) -> Iterator[str]:
    with serve(create_app(tiny_qwen_llm, model_name="tiny", api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=60)


def test_a_text_answer_equals_the_chat_completions_one(client, base_url):
    msg = client.messages.create(
        model="tiny",
        max_tokens=8,
        extra_body={"temperature": 0},  # (not in the SDK's signature any more)
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["text"] and msg.usage.output_tokens == 8
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    usage = chat["usage"]
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == usage["prompt_tokens"]
    last_word = msg.content[0].text.split()[-1]
    stopped = client.messages.create(
        model="tiny", max_tokens=30, extra_body={"temperature": 0}, stop_sequences=[last_word],
        system="Be brief.", messages=[{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}],
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == last_word


def test_tool_use_and_tool_results(client):
    msg = client.messages.create(
        model="tiny",
        max_tokens=300,
        extra_body={"seed": 1},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert msg.stop_reason == "tool_use"
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id
    follow = client.messages.create(
        model="tiny",
        max_tokens=4,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": msg.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
        ],
    )
    assert follow.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_streamed_events_make_the_same_message(client):
    kw = dict(
        model="tiny",
        max_tokens=10,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Tell me"}],
    )
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    with client.messages.stream(
        model="tiny",
        max_tokens=300,
        extra_body={"seed": 1},
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Weather in Rome?"}],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert isinstance(final.content[-1].input["city"], str)  # (the SDK joined the input's JSON deltas)


def test_count_tokens_and_errors(client, base_url):
    count = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hello there"}])
    assert count.input_tokens > 2
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert info.value.body["type"] == "error" and "role" in info.value.body["error"]["message"]
    r = httpx.post(f"{base_url}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"x-api-key": KEY})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}])


def test_the_translation_onto_a_chat_body():
    body = to_chat_body(
        {
            "system": [{"type": "text", "text": "S"}],
            "max_tokens": 5,
            "stop_sequences": ["END"],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [WEATHER],
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": ""},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "cold"}],
                        },
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "cold"},
        {"role": "user", "content": [{"type": "text", "text": "and now?"}]},
    ]
    assert (
        body["stop"] == ["END"] and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    )
    assert body["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    thinking = to_chat_body(
        {"messages": [{"role": "user", "content": "q"}], "max_tokens": 1, "thinking": {"type": "disabled"}}
    )
    assert thinking["chat_template_kwargs"] == {"enable_thinking": False}  # (Qwen3's templates read it)
