"""asv: speculative decoding's speed-up for one stream, where the drafts hold.

- ``NgramOnRepeatingText``: n-gram speculation on text that repeats itself. The random test
  models' greedy text rarely repeats its prompt, so the model is ``loop_model("135m")`` (the
  135M shape, every layer computed, whose next token depends on the current one alone) and
  the prompts hold a turn of the token cycle it walks (``loop_prompts``).
- ``DraftModelPair``: the ``draft_pair("135m")`` (a 30-layer target with exactly its 4-layer
  draft's logits), 128 prompt and 128 new tokens, where every greedy draft is accepted.

The defaults (``{"method": "ngram"}`` alone, ``{"method": "suffix"}`` alone):

- ``NgramDefaultsOnLoopingText``: the 135M random-weight model on an English sentence repeated
  40 times, 256 new tokens (its greedy text loops).
- ``NgramOnQuotingChat``: SmolLM2-135M-Instruct (the real model), three chat requests that
  quote their input (repeat a function, add a docstring to it, copy a paragraph), 200 tokens.
- ``NgramCopiesAParagraph``: the same paragraph copied to the answer's own end (its
  end-of-generation token, no ``ignore_eos``).
- ``DraftsThatFail``: the 135M random model on a repeated passage, sampled at temperature 1
  (seeded): drafts are found and almost all rejected; the target is >= 0.98.
- ``RetrySameAnswer``: ``suffix``: the same chat request to SmolLM2 asked a second time (a
  200-token story); the speed-up of the second request's decode (its drafts come from the
  first answer).
- ``EightStreams``: 8 concurrent streams of the 135M random model; the target is >= 0.97.
- ``GrammarDraftsOnSchema``: SmolLM2 answering chats as JSON under a schema
  (``PEOPLE_SCHEMAS``): ``{"method": "ngram"}`` over no speculation (``track_speedup``) and
  over the same method with ``grammar_drafts`` off (``track_over_lookups``): what drafting
  the keys the schema forces adds.

Each ``track_speedup`` is generation tokens/s (after the first token) with speculation over
without, in one process, on the same prompts. Threads: ``$LLAMABATCH_BENCH_THREADS``.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import numpy as np

from llamabatch import LLM, SamplingParams
from llamabatch.testing import draft_pair, english_sentences, loop_model, loop_prompts, model_path


def _threads() -> int:
    return int(os.environ.get("LLAMABATCH_BENCH_THREADS", os.cpu_count() or 1))


def _tokens_per_second(
    model: str, prompts: list[list[int]], n_new: int, spec: dict[str, Any] | None
) -> float:
    """Generation tokens/s after each prompt's first token, one stream, greedy."""
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    with LLM(model, n_parallel=1, n_threads=_threads(), speculative_config=spec) as llm:
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        seconds = 0.0
        for prompt in prompts:
            first = None
            for _ in llm.stream(prompt, params):
                if first is None:
                    first = time.perf_counter()
            assert first is not None
            seconds += time.perf_counter() - first
    return len(prompts) * (n_new - 1) / seconds


class NgramOnRepeatingText:
    params: ClassVar[list[int]] = [16, 64]
    param_names: ClassVar[list[str]] = ["num_speculative_tokens"]
    timeout = 300

    def setup(self, k: int) -> None:
        self.model = str(loop_model("135m"))
        self.prompts = loop_prompts(self.model, 3, 256)

    def track_speedup(self, k: int) -> float:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        plain = _tokens_per_second(self.model, self.prompts, 256, None)
        return _tokens_per_second(self.model, self.prompts, 256, spec) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class DraftModelPair:
    params: ClassVar[list[int]] = [16, 31]
    param_names: ClassVar[list[str]] = ["num_speculative_tokens"]
    timeout = 300

    def setup(self, k: int) -> None:
        pair = draft_pair("135m")
        self.target, self.draft = str(pair.target), str(pair.draft)
        rng = np.random.default_rng(0)
        self.prompts = [[int(t) for t in rng.integers(10, 30000, 128)] for _ in range(3)]

    def track_speedup(self, k: int) -> float:
        spec = {"method": "draft_model", "model": self.draft, "num_speculative_tokens": k}
        plain = _tokens_per_second(self.target, self.prompts, 128, None)
        return _tokens_per_second(self.target, self.prompts, 128, spec) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


def _decode_rate(
    model: str,
    prompts: list[Any],
    params: SamplingParams,
    spec: dict[str, Any] | None,
    *,
    n_parallel: int = 1,
    last_only: bool = False,
) -> float:
    """Generation tokens/s after the first token: one request at a time (``n_parallel`` 1) from
    each output's timings (``last_only``: the last request's alone), else all at once, over
    the call's wall time."""
    with LLM(model, n_parallel=n_parallel, n_threads=_threads(), speculative_config=spec) as llm:
        llm.generate(["warm-up"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        if n_parallel > 1:
            start = time.perf_counter()
            outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
            seconds = time.perf_counter() - start
            return sum(len(o.outputs[0].token_ids) for o in outs) / seconds
        tokens, seconds = 0, 0.0
        for i, prompt in enumerate(prompts):
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            if last_only and i < len(prompts) - 1:
                continue
            ttft = out.timings.time_to_first_token
            assert ttft is not None
            tokens += len(out.token_ids) - 1
            seconds += out.timings.total - ttft
        return tokens / seconds


_GREEDY = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
_NGRAM = {"method": "ngram"}


class NgramDefaultsOnLoopingText:
    timeout = 300

    def setup(self) -> None:
        self.model = str(model_path("135m"))
        self.prompts = [" ".join([english_sentences(3)[i]] * 40) for i in range(3)]

    def track_speedup(self) -> float:
        plain = _decode_rate(self.model, self.prompts, _GREEDY, None)
        return _decode_rate(self.model, self.prompts, _GREEDY, _NGRAM) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


_FUNCTION = """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
"""
_PARAGRAPH = (
    "The river rose slowly through the night, and by morning the lower fields were under a "
    "sheet of brown water. The farmers moved their animals to the hill behind the church, "
    "where the old stone wall kept the wind off, and waited for the rain to stop."
)
#: a request whose greedy answer runs past 200 tokens (SmolLM2-135M-Instruct), asked twice
RETRY_REQUEST = "Write a short story about a lighthouse keeper who finds a message in a bottle."
QUOTING_CHATS = [
    f"Repeat this function exactly, without changes:\n\n{_FUNCTION}",
    f"Add a docstring to this function and return the whole function:\n\n{_FUNCTION}",
    f"Copy this paragraph word for word:\n\n{_PARAGRAPH}",
]


def chatml(user: str) -> str:
    """SmolLM2-Instruct's chat template around one user message."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


class NgramOnQuotingChat:
    timeout = 300

    def setup(self) -> None:
        from llamabatch.testing import real_model_path

        self.model = str(real_model_path())
        self.prompts = [chatml(c) for c in QUOTING_CHATS]

    def track_speedup(self) -> float:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        plain = _decode_rate(self.model, self.prompts, params, None)
        return _decode_rate(self.model, self.prompts, params, _NGRAM) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class NgramCopiesAParagraph:
    """The quoting chats' paragraph copied word for word, to the answer's own end (no
    ``ignore_eos``): the lookup drafts the paragraph, and would run on past it into the chat
    template; drafts are cut before the end-of-generation token (``draft_cuts``)."""

    timeout = 300

    def setup(self) -> None:
        from llamabatch.testing import real_model_path

        self.model = str(real_model_path())
        self.prompts = [chatml(QUOTING_CHATS[2])] * 3

    def track_speedup(self) -> float:
        params = SamplingParams(temperature=0, max_tokens=200)
        plain = _decode_rate(self.model, self.prompts, params, None)
        return _decode_rate(self.model, self.prompts, params, _NGRAM) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class DraftsThatFail:
    timeout = 300

    def setup(self) -> None:
        self.model = str(model_path("135m"))
        self.prompts = [" ".join(english_sentences(4)[i : i + 2] * 10) for i in range(2)]

    def track_speedup(self) -> float:
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=256, ignore_eos=True)
        plain = _decode_rate(self.model, self.prompts, params, None)
        return _decode_rate(self.model, self.prompts, params, _NGRAM) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class RetrySameAnswer:
    timeout = 300

    def setup(self) -> None:
        # the real model: its greedy answer repeats token for token whatever the batch shapes
        # (a random model's near-ties flip between a tick with drafts and one without, and its
        # "same answer" soon is not)
        from llamabatch.testing import real_model_path

        self.model = str(real_model_path())
        self.prompts = [chatml(RETRY_REQUEST)] * 2

    def track_speedup(self) -> float:
        params = SamplingParams(temperature=0, max_tokens=200)
        suffix = {"method": "suffix"}
        plain = _decode_rate(self.model, self.prompts, params, None, last_only=True)
        return _decode_rate(self.model, self.prompts, params, suffix, last_only=True) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


class EightStreams:
    timeout = 300

    def setup(self) -> None:
        self.model = str(model_path("135m"))
        sentences = english_sentences(16)
        self.prompts = [" ".join(sentences[i : i + 6]) for i in range(8)]

    def track_speedup(self) -> float:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        plain = _decode_rate(self.model, self.prompts, params, None, n_parallel=8)
        return _decode_rate(self.model, self.prompts, params, _NGRAM, n_parallel=8) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]


def _people_schema(keys: list[str]) -> dict[str, Any]:
    """A person as JSON with ``keys``: strings but an integer age and an array of hobbies."""

    def prop(key: str) -> dict[str, Any]:
        if "age" in key:
            return {"type": "integer"}
        if "hobbies" in key:
            return {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}
        return {"type": "string", "maxLength": 24}

    return {"type": "object", "properties": {k: prop(k) for k in keys}, "required": keys}


#: the schemas of ``GrammarDraftsOnSchema``: keys of common words, which the model writes in
#: the tokenizer's own tokens, and compound keys, which it often spells in other pieces
#: (``c``, ``ur``, ``r``, ``ent`` for ``current``), where forced drafts are rejected
PEOPLE_SCHEMAS = {
    "common keys": _people_schema(
        ["name", "age", "city", "occupation", "favourite_programming_language", "hobbies"]
    ),
    "compound keys": _people_schema(
        [
            "full_name",
            "age_in_years",
            "city_of_residence",
            "current_occupation",
            "favourite_programming_language",
            "hobbies",
        ]
    ),
}
SCHEMA_CHATS = [
    f"Invent fictional person number {i} and describe them as JSON: name, age, city, occupation, "
    "favourite programming language and hobbies."
    for i in range(4)
]


class GrammarDraftsOnSchema:
    timeout = 300
    params: ClassVar[list[str]] = list(PEOPLE_SCHEMAS)
    param_names: ClassVar[list[str]] = ["schema"]

    def setup(self, schema: str) -> None:
        from llamabatch.testing import real_model_path

        self.model = str(real_model_path())
        self.prompts = [chatml(c) for c in SCHEMA_CHATS]
        self.sampling = SamplingParams(temperature=0, max_tokens=160, json_schema=PEOPLE_SCHEMAS[schema])

    def track_speedup(self, schema: str) -> float:
        plain = _decode_rate(self.model, self.prompts, self.sampling, None)
        return _decode_rate(self.model, self.prompts, self.sampling, _NGRAM) / plain

    def track_over_lookups(self, schema: str) -> float:
        lookups = {**_NGRAM, "grammar_drafts": False}
        plain = _decode_rate(self.model, self.prompts, self.sampling, lookups)
        return _decode_rate(self.model, self.prompts, self.sampling, _NGRAM) / plain

    track_speedup.unit = "x"  # type: ignore[attr-defined]
    track_over_lookups.unit = "x"  # type: ignore[attr-defined]


def _server_rates(
    url: str, prompts: list[str], max_tokens: int, temperature: float = 0.0, ignore_eos: bool = True
) -> float:
    """llama-server's decode tokens/s (its own ``timings``) over ``prompts`` sent one at a time
    to ``/completion`` (the same text, so the same tokens as ours)."""
    import json
    import urllib.request

    tokens, seconds = 0, 0.0
    for prompt in prompts:
        body = {
            "prompt": prompt,
            "n_predict": max_tokens,
            "temperature": temperature,
            "seed": 0,
            "ignore_eos": ignore_eos,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            timings = json.loads(response.read())["timings"]
        tokens += timings["predicted_n"]
        seconds += timings["predicted_ms"] / 1000
    return tokens / seconds


TRACKS = (
    NgramDefaultsOnLoopingText,
    NgramOnQuotingChat,
    NgramCopiesAParagraph,
    DraftsThatFail,
    RetrySameAnswer,
    EightStreams,
)


def _track_rounds(rounds: int) -> None:
    """Each of ``TRACKS``' speed-ups, ``rounds`` times, every case once a round: a run on this
    shared 2-core machine moves by 5-10%, so the medians and ranges are what to compare."""
    import statistics

    speedups: dict[str, list[float]] = {cls.__name__: [] for cls in TRACKS}
    for r in range(rounds):
        for cls in TRACKS:
            case = cls()
            case.setup()
            speedups[cls.__name__].append(case.track_speedup())
            print(f"round {r}: {cls.__name__} {speedups[cls.__name__][-1]:.3f}x", flush=True)
    for name, values in speedups.items():
        print(f"{name}: median {statistics.median(values):.3f}x ({min(values):.3f}-{max(values):.3f})")


def main(argv: list[str] | None = None) -> None:
    """Ours (defaults) vs off vs a running llama-server (``--spec-type ngram-mod``), side by
    side: ``python asv_bench/benchmarks/bench_speculative.py --url http://127.0.0.1:8090
    --case looping`` (the server must serve the case's model: ``looping`` and ``fail`` the
    135M random model, ``quoting`` and ``copy`` SmolLM2; ``copy``: the paragraph answered to
    its own end, without ``ignore_eos``)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--url", default=None, help="a llama-server serving the case's model")
    p.add_argument("--case", choices=("looping", "quoting", "copy", "fail"), default="looping")
    p.add_argument(
        "--tracks",
        type=int,
        default=0,
        metavar="N",
        help="instead: every default-settings track of this file, N rounds side by side (medians)",
    )
    args = p.parse_args(argv)
    if args.tracks:
        _track_rounds(args.tracks)
        return
    ignore_eos = args.case != "copy"
    if args.case in ("quoting", "copy"):
        from llamabatch.testing import real_model_path

        chats = QUOTING_CHATS if args.case == "quoting" else [QUOTING_CHATS[2]] * 3
        model, prompts, n, temp = str(real_model_path()), [chatml(c) for c in chats], 200, 0.0
    else:
        model = str(model_path("135m"))
        if args.case == "looping":
            prompts, n, temp = [" ".join([english_sentences(3)[i]] * 40) for i in range(3)], 256, 0.0
        else:
            prompts, n, temp = [" ".join(english_sentences(4)[i : i + 2] * 10) for i in range(2)], 256, 1.0
    params = SamplingParams(temperature=temp, seed=0, max_tokens=n, ignore_eos=ignore_eos)
    print(f"model {model}, {len(prompts)} prompts, {n} tokens, temperature {temp}, {_threads()} threads")
    for label, spec in (("off", None), ("ngram defaults", _NGRAM), ("off again", None)):
        print(f"ours, {label}: {_decode_rate(model, prompts, params, spec):.1f} tok/s")
    if args.url:
        rate = _server_rates(args.url, prompts, n, temp, ignore_eos)
        print(f"llama-server at {args.url}: {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
