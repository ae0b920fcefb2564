"""The engine on real weights: SmolLM2-135M-Instruct (Q4_1), the default model.

Random weights give near-flat distributions, which hide what real ones show: near ties that
rounding flips, chat templates that must render right for the model to answer, tool calls that
must end, drafts that a model copying its prompt accepts. Each test here is short (a few dozen
tokens) and keeps one engine for one setting.

Settings: one KV stream per sequence (``kv_unified=False``), with flash attention off (what the
engine picks by default on the CPU with several slots) or on. Under both, prompts generated
together give llama.cpp's single-sequence tokens and log-probabilities exactly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest
from serve_process import wait_until_healthy

from llamabatch import LLM, SamplingParams
from llamabatch.bench.runners.llama_cpp import load_llama_cpp

#: The README's prompts and one more, generated together.
PROMPTS = ("Once upon a time", "The capital of France is", "def fibonacci(n):", "The primary colors are")
N_TOKENS = 16
#: float noise allowed between the engine's log-probs and llama.cpp's (measured: 0 in both settings)
LOGPROB_TOLERANCE = 1e-3
#: the defaults' layout with one stream per sequence: flash attention off; and with it on
SETTINGS = {"fa-off": {"flash_attn": False}, "fa-on": {"flash_attn": True}}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


#: One thread: on a loaded 2-core machine, two threads of a 135M model wait on each other at
#: every op (flash attention off has more of them: 10x slower measured, against 1.1x quiet).
THREADS = 1


def _engine(path, flash_attn: bool = False, **options) -> LLM:
    return LLM(
        path, n_ctx=1024, n_parallel=4, n_threads=THREADS, kv_unified=False, flash_attn=flash_attn, **options
    )


@pytest.fixture(scope="module")
def llm(smollm2_path):
    """The defaults' choices for several slots: one KV stream per sequence, flash attention off."""
    with _engine(smollm2_path) as llm:
        yield llm


def single_sequence_greedy(reference, prompt_tokens: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama.cpp alone on one sequence, as ``llama-server -np 1`` runs it: the prompt in one
    decode, then one token per decode, each the argmax; with each token's log-probability."""
    reference.reset()
    reference.eval(prompt_tokens)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        row = np.asarray(reference.scores[reference.n_tokens - 1], dtype=np.float64)
        peak = row.max()
        log_softmax = row - (peak + np.log(np.exp(row - peak).sum()))
        token = int(np.argmax(row))
        tokens.append(token)
        logprobs.append(float(log_softmax[token]))
        reference.eval([token])
    return tokens, logprobs


@pytest.mark.parametrize("setting", SETTINGS)
def test_prompts_together_equal_llama_cpp_single_sequence(smollm2_path, setting):
    flash_attn = SETTINGS[setting]["flash_attn"]
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
    with _engine(smollm2_path, flash_attn=flash_attn) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    options = {"n_ctx": 256, "n_batch": 256, "logits_all": True, "verbose": False, "n_threads": THREADS}
    reference = load_llama_cpp(str(smollm2_path), flash_attn=flash_attn, **options)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.prompt_token_ids == reference.tokenize(prompt.encode(), add_bos=True, special=True)
        tokens, logprobs = single_sequence_greedy(reference, out.prompt_token_ids, N_TOKENS)
        theirs = reference.detokenize(tokens).decode()
        assert out.token_ids == tokens, f"{prompt!r}: {out.text!r} != {theirs!r}"
        ours = [lp[token] for lp, token in zip(out.logprobs, out.token_ids, strict=True)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)


def test_chat_with_its_own_template_answers(llm):
    questions = ["What is the capital of France? Answer in one sentence.", "What is the capital of Germany?"]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    # the GGUF's template: SmolLM2's own system prompt, ChatML turns
    prompt = llm.apply_chat_template(conversations[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith(f"<|im_start|>user\n{questions[0]}<|im_end|>\n<|im_start|>assistant\n")
    outs = [o.outputs[0] for o in llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0))]
    assert "Paris" in outs[0].text and "Berlin" in outs[1].text, [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)  # the model ends its turn itself


@pytest.mark.parametrize("tool_choice", ["required", NAMED_TOOL])
def test_forced_tool_call_finishes(llm, tool_choice):
    params = SamplingParams(max_tokens=96, temperature=0)
    out = llm.chat(WEATHER_QUESTION, params, tools=[WEATHER_TOOL], tool_choice=tool_choice)[0].outputs[0]
    assert out.finish_reason == "tool_calls", (out.text, out.finish_reason)
    (call,) = out.tool_calls
    assert call.name == "get_weather"
    assert "Paris" in json.loads(call.arguments)["city"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_ngram_speculation_copies_a_paragraph_and_changes_nothing(smollm2_path, setting):
    paragraph = (
        "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty "
        "wind. Every night for a hundred years its lamp had turned, warning ships away from the rocks."
    )
    copy_task = [{"role": "user", "content": f"Repeat this paragraph exactly, word for word:\n\n{paragraph}"}]
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=1)
    outs = {}
    for spec in (None, {"method": "ngram"}):
        with _engine(smollm2_path, speculative_config=spec, **SETTINGS[setting]) as llm:
            outs[spec is not None] = llm.chat(copy_task, params)[0].outputs[0]
    plain, speculated = outs[False], outs[True]
    assert speculated.token_ids == plain.token_ids
    if SETTINGS[setting]["flash_attn"]:
        # Without flash attention a decode verifying several rows of one sequence rounds
        # differently from one row at a time (measured: up to 0.045 nats, the tokens unchanged).
        for ours, theirs in zip(speculated.logprobs, plain.logprobs, strict=True):
            assert ours == pytest.approx(theirs, abs=LOGPROB_TOLERANCE)
    assert paragraph[:60] in plain.text
    drafted, accepted = speculated.timings.spec_draft_tokens, speculated.timings.spec_accepted_tokens
    assert accepted >= len(plain.token_ids) // 3, (drafted, accepted)  # measured: 26 to 31 of 39 tokens
    assert accepted / drafted > 0.6, (drafted, accepted)  # measured: 0.88 to 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_without_a_model_serves_smollm2_and_forced_tool_calls_finish(smollm2_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLAMABATCH_CACHE_DIR": str(smollm2_path.parent)}
    argv = [sys.executable, "-m", "llamabatch", "serve", "--port", str(port), "-np", "2", "-c", "1024"]
    argv += ["-t", str(THREADS)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, lambda: proc.stdout.read() if proc.stdout else "")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1"]
        body = {
            "messages": WEATHER_QUESTION,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "max_tokens": 96,
            "temperature": 0,
        }
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).json()
        (choice,) = reply["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert "Paris" in json.loads(call["function"]["arguments"])["city"]
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0, output
    assert "using SmolLM2-135M-Instruct" in output
