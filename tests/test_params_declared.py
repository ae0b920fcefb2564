"""``SamplingParams`` is declared once (``param_spec.py``): every field says its range, its
request field(s), its ``generate`` flag and the sampler stage it switches on, and the
checks, the server's request reader, the command line and ``active_stages`` come from it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamabatch import param_spec
from llamabatch._ffi.sampler import CHAIN_STAGES
from llamabatch.param_spec import ENGINE_STAGES, STAGES, Flag, Request, param, specs, undeclared_fields
from llamabatch.params import SamplingParams
from llamabatch.server import protocol
from llamabatch.server.protocol import Body, sampling_params

#: a value for each field the server reads as declared, and the field's value it gives
REQUEST_SAMPLES: dict[str, tuple[Any, Any]] = {
    "temperature": (0.5, 0.5),
    "top_p": (0.5, 0.5),
    "min_p": (0.25, 0.25),
    "typical_p": (0.5, 0.5),
    "repeat_penalty": (1.25, 1.25),
    "frequency_penalty": (0.5, 0.5),
    "presence_penalty": (-0.5, -0.5),
    "penalty_last_n": (32, 32),
    "stop_token_ids": ([7, 9], (7, 9)),
    "min_tokens": (2, 2),
    "ignore_eos": (True, True),
    "grammar": ('root ::= "a"', 'root ::= "a"'),
    "json_schema": ({"type": "integer"}, {"type": "integer"}),
    "response_format": ({"type": "json_object"}, {"type": "json_object"}),
    "skip_special_tokens": (False, False),
    "speculative": (False, False),
    "slo_ttft_ms": (250.0, 250.0),
    "slo_itl_ms": (50.0, 50.0),
    "regex": ("[a-z]+", "[a-z]+"),
    "choice": (["yes", "no"], ("yes", "no")),
    "include_stop_str_in_output": (True, True),
    "allowed_token_ids": ([9, 7, 9], (7, 9)),
    "dry_multiplier": (0.8, 0.8),
    "dry_base": (2.0, 2.0),
    "dry_allowed_length": (3, 3),
    "dry_penalty_last_n": (64, 64),
    "dry_sequence_breakers": (["\n\n", "END"], ("\n\n", "END")),
    "xtc_probability": (0.5, 0.5),
    "xtc_threshold": (0.2, 0.2),
    "top_n_sigma": (1.5, 1.5),
    "mirostat": (2, 2),
    "mirostat_tau": (3.0, 3.0),
    "mirostat_eta": (0.2, 0.2),
    "prompt_logprobs": (5, 5),
}
#: a flag's text for each field with a ``generate`` flag, and the field's value it gives
CLI_SAMPLES: dict[str, tuple[str, Any]] = {
    "max_tokens": ("7", 7),
    "temperature": ("0.5", 0.5),
    "top_k": ("5", 5),
    "top_p": ("0.5", 0.5),
    "min_p": ("0.25", 0.25),
    "typical_p": ("0.5", 0.5),
    "repeat_penalty": ("1.25", 1.25),
    "frequency_penalty": ("0.5", 0.5),
    "presence_penalty": ("-0.5", -0.5),
    "penalty_last_n": ("32", 32),
    "seed": ("11", 11),
    "stop": ("END", ("END",)),
    "regex": ("[a-z]+", "[a-z]+"),
    "choice": ("yes", ("yes",)),
    "include_stop_str_in_output": ("", True),
    "dry_multiplier": ("0.8", 0.8),
    "dry_base": ("2", 2.0),
    "dry_allowed_length": ("3", 3),
    "dry_penalty_last_n": ("64", 64),
    "dry_sequence_breakers": ("END", ("END",)),
    "xtc_probability": ("0.5", 0.5),
    "xtc_threshold": ("0.2", 0.2),
    "top_n_sigma": ("1.5", 1.5),
    "mirostat": ("2", 2),
    "mirostat_tau": ("3", 3.0),
    "mirostat_eta": ("0.2", 0.2),
    "min_tokens": ("2", 2),
    "ignore_eos": ("", True),
    "grammar": ('root ::= "a"', 'root ::= "a"'),
    "json_schema": ('{"type": "integer"}', '{"type": "integer"}'),
    "truncate": ("", True),
}


def test_every_field_is_declared() -> None:
    assert undeclared_fields(SamplingParams) == []
    for name, spec in specs(SamplingParams).items():
        assert spec.stage is None or spec.stage in STAGES, name
        assert isinstance(spec.request, Request) or spec.request.strip(), f"{name}: why no request field"
        assert isinstance(spec.flag, Flag) or spec.flag.strip(), f"{name}: why no flag"


def test_a_field_without_its_declaration_fails() -> None:
    @dataclasses.dataclass(frozen=True)
    class Extended(SamplingParams):
        new_knob: int = 0

    assert undeclared_fields(Extended) == ["new_knob"]
    with pytest.raises(TypeError):
        param(0, request="x", flag="y")  # type: ignore[call-arg]  # no stage said
    with pytest.raises(ValueError, match="stage 'nowhere'"):
        param(0, request="x", flag="y", stage="nowhere", on=lambda p: True)
    with pytest.raises(ValueError, match="on\\(params\\)"):
        param(0, request="x", flag="y", stage="top_k")


def test_every_stage_is_built_by_the_chain_or_the_engine() -> None:
    assert set(STAGES) == CHAIN_STAGES | ENGINE_STAGES
    assert not CHAIN_STAGES & ENGINE_STAGES


def test_active_stages_follow_the_chain() -> None:
    assert SamplingParams().active_stages == ("top_k", "top_p", "min_p", "temperature", "dist")
    assert SamplingParams(temperature=0).active_stages == ("greedy",)
    greedy_constrained = SamplingParams(temperature=0, logit_bias={1: 2.0}, repeat_penalty=1.1, min_tokens=1)
    assert greedy_constrained.active_stages == ("logit_bias", "penalties", "min_tokens", "greedy")
    assert SamplingParams(json_schema={"type": "integer"}).active_stages[0] == "grammar"
    assert "grammar" not in SamplingParams(response_format={"type": "text"}).active_stages
    assert SamplingParams(top_k=0, top_p=1.0, min_p=0.0, typical_p=0.5).active_stages == (
        "typical",
        "temperature",
        "dist",
    )


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 1e-6, 0.7]),
    logit_bias=st.sampled_from([{}, {3: 1.0}]),
    grammar=st.sampled_from([None, 'root ::= "a"']),
    repeat_penalty=st.sampled_from([1.0, 1.1]),
    frequency_penalty=st.sampled_from([0.0, 0.5]),
    presence_penalty=st.sampled_from([0.0, -0.5]),
    min_tokens=st.sampled_from([0, 3]),
    top_k=st.sampled_from([0, 40]),
    stop_token_ids=st.sampled_from([(), (5,)]),
)
def test_the_greedy_fast_path_is_plain_greedy(**fields: Any) -> None:
    params = SamplingParams(**fields)
    plain = (
        params.greedy
        and not params.logit_bias
        and params.effective_grammar is None
        and params.repeat_penalty == 1.0
        and params.frequency_penalty == 0.0
        and params.presence_penalty == 0.0
        and params.min_tokens == 0
    )
    assert (params.active_stages == ("greedy",)) == plain


def _read(data: dict[str, Any]) -> SamplingParams:
    return sampling_params(
        Body(data, "/v1/completions"), chat=False, prompt_tokens=3, n_ctx_seq=64, logprobs=None
    )


def test_every_declared_request_field_reaches_the_params() -> None:
    declared = dict(param_spec.request_fields(SamplingParams))
    custom = {name for name, request in declared.items() if request.custom}
    assert custom == protocol.CUSTOM_FIELDS
    plain = {name: request for name, request in declared.items() if not request.custom}
    missing = sorted(set(plain) - set(REQUEST_SAMPLES))
    assert not missing, f"give the new request field(s) a sample value here: {missing}"
    for name, request in plain.items():
        sent, expected = REQUEST_SAMPLES[name]
        for body_name in request.names:
            params = _read({body_name: sent})
            assert getattr(params, name) == expected, (name, body_name)
            assert getattr(params, name) != getattr(SamplingParams(), name), name


def test_the_custom_request_fields_reach_the_params() -> None:
    params = _read({"max_tokens": 5, "top_k": -1, "seed": 3, "stop": "x", "logit_bias": {"4": 10}, "n": 2})
    assert (params.max_tokens, params.top_k, params.seed, params.stop, params.n) == (5, 0, 3, ("x",), 2)
    assert params.logit_bias == {4: 10.0}
    assert (
        sampling_params(
            Body({}, "/v1/completions"), chat=False, prompt_tokens=3, n_ctx_seq=64, logprobs=2
        ).logprobs
        == 2
    )


def test_an_alias_names_the_field_the_client_sent() -> None:
    with pytest.raises(protocol.APIError) as caught:
        _read({"repetition_penalty": 0})
    assert caught.value.param == "repetition_penalty"


def _cli(argv: list[str]) -> SamplingParams:
    parser = argparse.ArgumentParser()
    SamplingParams.add_cli_args(parser, defaults={"max_tokens": 128})
    return SamplingParams.from_cli_args(parser.parse_args(argv))


def test_every_declared_flag_reaches_the_params() -> None:
    flagged = {name: spec.flag for name, spec in specs(SamplingParams).items() if isinstance(spec.flag, Flag)}
    missing = sorted(set(flagged) - set(CLI_SAMPLES))
    assert not missing, f"give the new flag(s) a sample value here: {missing}"
    defaults = _cli([])
    assert defaults.max_tokens == 128  # the command's own default
    assert dataclasses.replace(defaults, max_tokens=16) == SamplingParams()
    for name, flag in flagged.items():
        text, expected = CLI_SAMPLES[name]
        for option in flag.flags:
            params = _cli([option, text] if text else [option])
            assert getattr(params, name) == expected, (name, option)


def test_a_bad_flag_value_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        _cli(["-n", "0"])
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        _cli(["--top-p", "1.5"])
