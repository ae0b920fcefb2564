"""Strict input validation: SamplingParams fields, prompts, and constructor parameters.

Every case of issue 11's "loose validation" list that concerns parameters and prompts has a
test here that failed before the change: bytes prompts read as token ids, ``[True, False]``
accepted as tokens, numpy integer arrays refused, out-of-range ``top_k`` / ``penalty_last_n``
/ ``n_ctx`` / ``n_threads`` / ``n_gpu_layers`` surfacing as cffi's ``OverflowError`` (or an
abort), lone surrogates in stop strings, a NUL in a grammar.
"""

from __future__ import annotations

import array
import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llamabatch.params import INT32_MAX, PENALTY_LAST_N_MAX, SamplingParams, check_bool, check_positive_int
from llamabatch.prompts.inputs import as_prompt_list, check_token_ids, is_single_prompt, normalize_prompt

# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**31),  # overflowed cffi's int32 at submit before
        ("top_k", -1),
        ("penalty_last_n", 2**31),  # overflowed cffi's int32 at submit before
        ("penalty_last_n", -2),
        ("max_tokens", 2**31),
        ("max_tokens", 0),
        ("n", 2**31),
        ("n", 0),
        ("seed", 2**32),
        ("seed", 2**32 - 1),  # llama.cpp's "random seed": not reproducible
        ("seed", -1),
        ("logprobs", 101),
        ("logprobs", -1),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e39),  # beyond float32: would be inf in C
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("typical_p", math.nan),
        ("min_p", -0.01),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -math.inf),
    ],
)
def test_out_of_range_numbers_raise_at_construction_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", True),
        ("max_tokens", 4.0),
        ("max_tokens", "4"),
        ("penalty_last_n", np.float64(3)),
        ("seed", False),
        ("n", None),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", None),
        ("ignore_eos", 1),
        ("truncate", "yes"),
        ("skip_special_tokens", None),
    ],
)
def test_wrong_types_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_int32_limits_are_accepted() -> None:
    p = SamplingParams(
        top_k=INT32_MAX, penalty_last_n=PENALTY_LAST_N_MAX, max_tokens=INT32_MAX, seed=2**32 - 2
    )
    assert p.top_k == INT32_MAX and p.penalty_last_n == PENALTY_LAST_N_MAX and p.seed == 2**32 - 2
    assert SamplingParams(penalty_last_n=-1, top_k=0, temperature=0).greedy


def test_numpy_scalars_are_converted_to_python_numbers() -> None:
    p = SamplingParams(
        max_tokens=np.int64(7),
        top_k=np.uint8(3),
        seed=np.uint32(5),
        temperature=np.float32(0.5),
        top_p=np.float64(0.9),
        logprobs=np.int16(2),
        ignore_eos=np.bool_(True),
        logit_bias={np.int32(3): np.float16(-1.5)},
        stop_token_ids=np.array([4, 5], dtype=np.int64),
    )
    for name in ("max_tokens", "top_k", "seed", "logprobs"):
        assert type(getattr(p, name)) is int, name
    assert type(p.temperature) is float and type(p.top_p) is float
    assert p.ignore_eos is True
    assert p.logit_bias == {3: -1.5} and all(type(k) is int for k in p.logit_bias)
    assert p.stop_token_ids == (4, 5) and all(type(t) is int for t in p.stop_token_ids)


def test_lone_surrogate_in_a_stop_string_is_refused() -> None:
    # accepted before, and then never matched (the output is valid UTF-8)
    with pytest.raises(ValueError, match=r"SamplingParams\.stop\[1\].*surrogate"):
        SamplingParams(stop=["ok", "bad \ud800 stop"])
    with pytest.raises(ValueError, match="surrogate"):
        SamplingParams(stop="\udfff")


def test_nul_in_a_grammar_or_stop_string_is_refused() -> None:
    # llama.cpp reads the grammar as a C string: before, everything after the NUL was dropped
    with pytest.raises(ValueError, match=r"SamplingParams\.grammar.*NUL"):
        SamplingParams(grammar='root ::= "a"\x00 | "b"')
    with pytest.raises(ValueError, match=r"SamplingParams\.stop\[0\].*NUL"):
        SamplingParams(stop=["a\x00b"])
    with pytest.raises(ValueError, match=r"SamplingParams\.grammar.*surrogate"):
        SamplingParams(grammar='root ::= "\ud83d"')


@pytest.mark.parametrize("stop", [b"stop", [b"stop"], ["ok", ""], [1], {"a": 1}])
def test_bad_stop_values(stop: object) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.stop"):
        SamplingParams(stop=stop)  # type: ignore[arg-type]


def test_stop_accepts_a_string_a_sequence_or_none() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["x", "y"]).stop == ("x", "y")
    assert SamplingParams(stop=None).stop == ()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bias",
    [
        {-1: 1.0},
        {2**31: 1.0},
        {True: 1.0},
        {"5": 1.0},
        {1.0: 1.0},
        {5: math.nan},
        {5: math.inf},  # +inf makes the sampler's softmax NaN
        {5: 1e31},
        {5: "1"},
        [(5, 1.0)],
    ],
)
def test_bad_logit_bias(bias: object) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias"):
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]


def test_logit_bias_may_ban_a_token_with_minus_infinity() -> None:
    assert SamplingParams(logit_bias={5: -math.inf}).logit_bias == {5: -math.inf}


def test_stop_token_ids_and_min_tokens() -> None:
    p = SamplingParams(max_tokens=8, stop_token_ids=[2, 7], min_tokens=8)
    assert p.stop_token_ids == (2, 7) and p.min_tokens == 8
    assert SamplingParams().stop_token_ids == () and SamplingParams().min_tokens == 0
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens.*max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    for bad in ([-1], [2**31], [True], [1.0], "12", b"12", 7):
        with pytest.raises(ValueError, match=r"SamplingParams\.stop_token_ids"):
            SamplingParams(stop_token_ids=bad)  # type: ignore[arg-type]


def test_coerce_converts_dicts_and_names_unknown_keys() -> None:
    assert SamplingParams.coerce(None) == SamplingParams()
    p = SamplingParams(max_tokens=3)
    assert SamplingParams.coerce(p) is p
    assert SamplingParams.coerce({"max_tokens": 4, "temperature": 0}) == SamplingParams(
        max_tokens=4, temperature=0
    )
    with pytest.raises(TypeError, match=r"'max_token'.*max_tokens"):
        SamplingParams.coerce({"max_token": 4})
    with pytest.raises(TypeError, match="SamplingParams, a dict"):
        SamplingParams.coerce("max_tokens=4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got list"):
        SamplingParams.coerce([("max_tokens", 4)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k"):
        SamplingParams.coerce({"top_k": 2**40})
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_replace_revalidates() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match=r"SamplingParams\.top_k"):
        replace(SamplingParams(), top_k=2**31)


# --------------------------------------------------------------------------- check_positive_int


def test_check_positive_int_bounds_and_types() -> None:
    assert check_positive_int("x", 1) == 1
    assert check_positive_int("x", np.int64(5)) == 5 and type(check_positive_int("x", np.int64(5))) is int
    assert check_positive_int("x", None, allow_none=True) is None
    assert check_positive_int("x", INT32_MAX) == INT32_MAX
    assert check_positive_int("x", -1, minimum=-1) == -1
    for bad in (0, -1, INT32_MAX + 1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match=r"^x must be"):
            check_positive_int("x", bad)
    with pytest.raises(ValueError, match=r"at most 8"):
        check_positive_int("x", 9, maximum=8)
    assert check_bool("b", np.bool_(False)) is False
    with pytest.raises(ValueError, match="b must be True or False"):
        check_bool("b", 0)


# --------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
)
def test_numpy_integer_arrays_are_token_prompts(dtype: type) -> None:
    tokens = normalize_prompt(np.array([1, 2, 3], dtype=dtype))
    assert tokens == [1, 2, 3] and all(type(t) is int for t in tokens)


def test_token_sequences_of_every_kind() -> None:
    assert normalize_prompt([1, 2]) == [1, 2]
    assert normalize_prompt((1, 2)) == [1, 2]
    assert normalize_prompt(range(3)) == [0, 1, 2]
    assert normalize_prompt(array.array("i", [4, 5])) == [4, 5]
    assert normalize_prompt([np.int64(4), 5]) == [4, 5]
    assert normalize_prompt({"prompt_token_ids": [7]}) == [7]
    assert normalize_prompt({"prompt": "hi"}) == "hi"
    assert normalize_prompt("hi\x00there") == "hi\x00there"  # llama_tokenize takes a length


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (b"hello", "bytes are not token ids"),
        (bytearray(b"hi"), "bytes are not token ids"),
        (memoryview(b"hi"), "bytes are not token ids"),
        ([True, False], "bools are not token ids"),
        ([1, True], r"item 1 .*bools are not token ids"),
        ([1.0, 2.0], "token ids must be ints"),
        ([[1, 2], [3]], "flat sequence"),
        (["a", "b"], "flat sequence"),
        (np.array([True, False]), "dtype bool"),
        (np.array([1.0, 2.0]), "dtype float64"),
        (array.array("d", [1.0]), "typecode 'd'"),
        (None, "got NoneType"),
        (42, "got int 42"),
        ({"prompt": b"x"}, "holds text"),
        ({"text": "x"}, "exactly one key"),
    ],
)
def test_bad_prompt_types_raise_type_error(prompt: object, match: str) -> None:
    with pytest.raises(TypeError, match=match) as info:
        normalize_prompt(prompt)
    assert "a prompt must be" in str(info.value) or "dict" in str(info.value)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ([], "empty"),
        (np.array([], dtype=np.int32), "empty"),
        ("abc\ud800def", r"at index 3 is a lone surrogate"),
        (np.array([[1, 2], [3, 4]]), r"1-D .*shape \(2, 2\)"),
        ([1, -1], r"-1 at index 1"),
        ([2**31], r"2147483648 at index 0"),
        (np.array([1, 2**40]), r"at index 1"),
    ],
)
def test_bad_prompt_values_raise_value_error(prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        normalize_prompt(prompt)


def test_check_token_ids_names_the_first_bad_id_and_its_index() -> None:
    check_token_ids([0, 5, 9], 10)
    with pytest.raises(ValueError, match=r"token id 10 at index 2 .*\[0, 10\)"):
        check_token_ids([0, 5, 10, 11], 10)
    with pytest.raises(ValueError, match=r"token id -3 at index 0"):
        check_token_ids([-3], 10)


def test_one_prompt_or_many() -> None:
    for one in (
        "text",
        [1, 2],
        (1, 2),
        np.array([1, 2]),
        array.array("i", [1]),
        b"x",
        [True],
        [1.5],
        {"prompt": "x"},
    ):
        assert is_single_prompt(one), one
        assert as_prompt_list(one) == ([one], True)
    for many in (
        ["a", "b"],
        [[1, 2], [3]],
        [np.array([1])],
        [{"prompt": "x"}],
        [],
        [b"x"],
        np.array([[1], [2]]),
    ):
        assert not is_single_prompt(many), many
    prompts, single = as_prompt_list(np.array([[1, 2], [3, 4]]))
    assert not single and [p.tolist() for p in prompts] == [[1, 2], [3, 4]]


# --------------------------------------------------------------------------- through the facade


@pytest.fixture(scope="module")
def llm(tiny_path: Path) -> Iterator[object]:
    from llamabatch import LLM

    with LLM(tiny_path, n_ctx=512, n_parallel=2, n_batch=64, n_threads=2) as llm:
        yield llm


GREEDY = SamplingParams(max_tokens=2, temperature=0)


def test_llm_refuses_bytes_and_bools_as_prompts(llm) -> None:
    # before: b"hello" was read as the token ids [104, 101, 108, 108, 111], [True, False] as [1, 0]
    with pytest.raises(TypeError, match="bytes are not token ids"):
        llm.submit(b"hello", GREEDY)
    with pytest.raises(TypeError, match="bools are not token ids"):
        llm.submit([True, False], GREEDY)
    with pytest.raises(TypeError, match="bytes are not token ids"):
        llm.generate(b"hello", GREEDY)


def test_llm_accepts_numpy_token_arrays(llm) -> None:
    # before: refused with "prompt token 1 is not a token id"
    ids = llm.tokenize("hello world")
    expected = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    for dtype in (np.int32, np.int64, np.uint16):
        out = llm.generate(np.array(ids, dtype=dtype), GREEDY)
        assert out[0].outputs[0].token_ids == expected


def test_llm_names_the_bad_token_id(llm) -> None:
    with pytest.raises(ValueError, match=rf"token id {llm.model.n_vocab} at index 1"):
        llm.submit([1, llm.model.n_vocab], GREEDY)


def test_llm_refuses_lone_surrogates_in_prompts(llm) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        llm.submit("hi \udc80", GREEDY)


def test_tiny_temperatures_decode_greedily(llm) -> None:
    # dividing logits by 1e-38 overflows float32: the draw returned the last token id every time
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-5).greedy
    greedy = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    tiny = SamplingParams(max_tokens=4, temperature=1e-38, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    assert llm.generate("hello", tiny)[0].outputs[0].token_ids == greedy


def test_llm_converts_params_dicts(llm) -> None:
    out = llm.generate("hello", {"max_tokens": 2, "temperature": 0})
    assert len(out[0].outputs[0].token_ids) <= 2
    with pytest.raises(TypeError, match="max_tok"):
        llm.generate("hello", {"max_tok": 2})


# --------------------------------------------------------------------------- constructors


CONTEXT_CASES = [
    ({"n_ctx": 2**32}, "n_ctx"),  # cffi OverflowError (uint32) before
    ({"n_ctx": 0}, "n_ctx"),
    ({"n_batch": 2**32}, "n_batch"),
    ({"n_ubatch": 2**32}, "n_ubatch"),
    ({"n_threads": 2**31}, "n_threads"),  # cffi OverflowError (int32) before
    ({"n_threads": 513}, "n_threads"),  # beyond GGML_MAX_N_THREADS
    ({"n_threads_batch": 100_000}, "n_threads_batch"),  # crashed the process before
    ({"n_threads": True}, "n_threads"),
    ({"n_seq_max": 257}, "n_seq_max"),
    ({"n_batch": 8, "n_seq_max": 9}, "n_seq_max"),  # GGML_ASSERT(n_outputs_max ...) before
    ({"n_ctx": 8, "n_seq_max": 9}, "n_seq_max"),  # the same: n_ctx caps the batch
    ({"embeddings": 1}, "embeddings"),
    ({"kv_unified": "no"}, "kv_unified"),
    ({"pooling": "max"}, "pooling"),
    ({"pooling": ["mean"]}, "pooling"),
    ({"flash_attn": "on"}, "flash_attn"),
    ({"flash_attn": ["auto"]}, "flash_attn"),  # TypeError (unhashable) before
    # GGML_ASSERT(ggml_can_mul_mat) in the mean-pooling graph reservation before:
    ({"embeddings": True, "pooling": "mean", "n_seq_max": 3, "n_batch": 8}, "n_seq_max"),
]

_CONTEXT_SCRIPT = """
import json, sys
from llamabatch._ffi.model import Model
from llamabatch._ffi.context import Context
model = Model(sys.argv[1])
for kwargs in json.loads(sys.argv[2]):
    try:
        Context(model, **kwargs).close()
        outcome = "created"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print("OUTCOME", json.dumps(outcome), flush=True)
"""


@pytest.fixture(scope="module")
def context_outcomes(tiny_path: Path) -> list[str]:
    """Each case's outcome, from ONE fresh interpreter (the old behaviour of some was an abort,
    which ends the list early; the cases after it then fail with the crash's output)."""
    cases = [kwargs for kwargs, _ in CONTEXT_CASES]
    result = subprocess.run(
        [sys.executable, "-c", _CONTEXT_SCRIPT, str(tiny_path), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # (an abort's backtrace goes to stdout too)
    outcomes = [json.loads(line[8:]) for line in result.stdout.splitlines() if line.startswith("OUTCOME ")]
    crash = f"the process ended with code {result.returncode}: {result.stderr[-1500:]}"
    return outcomes + [crash] * (len(cases) - len(outcomes))


@pytest.mark.parametrize("case", range(len(CONTEXT_CASES)))
def test_context_parameters_raise_value_error_naming_them(context_outcomes: list[str], case: int) -> None:
    kwargs, name = CONTEXT_CASES[case]
    outcome = context_outcomes[case]
    assert outcome.startswith("ValueError:") and name in outcome, (kwargs, outcome)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_gpu_layers": 2**31}, "n_gpu_layers"),  # cffi OverflowError before
        ({"n_gpu_layers": -2}, "n_gpu_layers"),
        ({"n_gpu_layers": 1.0}, "n_gpu_layers"),
        ({"main_gpu": 2**31}, "main_gpu"),
        ({"vocab_only": "yes"}, "vocab_only"),
        ({"check_tensors": 1}, "check_tensors"),
        ({"load_mode": ["mmap"]}, "load_mode"),  # TypeError (unhashable) before
    ],
)
def test_model_parameters_raise_value_error_naming_them(tiny_path: Path, kwargs: dict, name: str) -> None:
    from llamabatch._ffi.model import Model

    with pytest.raises(ValueError, match=name):
        Model(tiny_path, **kwargs)


def test_small_contexts_work(tiny_path: Path) -> None:
    from llamabatch._ffi.context import Context
    from llamabatch._ffi.model import Model

    with Model(tiny_path, n_gpu_layers=-1) as model:
        for kwargs in ({"n_ctx": 1}, {"n_ctx": 1, "n_batch": 1}, {"n_ctx": 8, "n_seq_max": 8}):
            with Context(model, n_threads=np.int64(1), **kwargs) as ctx:
                ctx.decode_tokens([1])
                assert np.isfinite(ctx.logits_ith(0)).all()
