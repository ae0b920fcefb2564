"""OpenAI's Responses API (``/v1/responses``) through the ``openai`` client: text, function
calls and their outputs, structured output, streamed events, and what a stateless server
refuses. The text is the chat pipeline's: the same as ``/v1/chat/completions`` for the same
greedy request."""

from __future__ import annotations

import json

import pytest

from llamabatch.server.responses import to_chat_body

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server import serve  # noqa: E402 (after the skips: it needs the server extra)

from llamabatch.server import create_app  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(tiny_qwen_llm):
    with serve(create_app(tiny_qwen_llm, model_name="tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_text_response_equals_the_chat_answer(client):
    r = client.responses.create(
        model="tiny", instructions="Be brief.", input="Hi!", max_output_tokens=8, temperature=0
    )
    assert (
        r.object == "response"
        and r.status == "incomplete"
        and r.incomplete_details.reason == "max_output_tokens"
    )
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and r.output_text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == 8 and r.usage.input_tokens == chat.usage.prompt_tokens


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=300,
        extra_body={"seed": 1},
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and r.status == "completed"
    assert isinstance(json.loads(calls[0].arguments)["city"], str) and calls[0].call_id
    follow = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=4,
    )
    assert follow.status in ("completed", "incomplete") and follow.output


def test_structured_output_is_json_the_schema_accepts(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="tiny",
        input="A number, please.",
        text={"format": {"type": "json_schema", "name": "number", "schema": schema}},
        max_output_tokens=200,
        extra_body={"seed": 3},
    )
    assert isinstance(json.loads(r.output_text)["n"], int)


def test_streamed_events_build_the_same_response(client):
    kw = dict(model="tiny", input="Tell me", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)  # (cut by max_output_tokens: it ends in response.incomplete, as OpenAI's)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output[0].content[0].text
    with client.responses.stream(
        model="tiny",
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        extra_body={"seed": 1},
    ) as stream:
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_what_a_stateless_server_refuses(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_1", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model="tiny", input=[{"type": "web_search_call"}], max_output_tokens=2)


def test_the_translation_onto_a_chat_body():
    body = to_chat_body(
        {
            "instructions": "S",
            "max_output_tokens": 5,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "input": [
                {"role": "developer", "content": "D"},
                {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {"type": "reasoning", "summary": []},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "cold"},
            ],
        }
    )
    assert body["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "system", "content": "D"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    assert body["max_tokens"] == 5 and body["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    assert body["tools"][0]["function"]["parameters"] == WEATHER["parameters"]
