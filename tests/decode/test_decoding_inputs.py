"""Decoding inputs: impossible sampling settings and token budgets are refused in one line naming the key;
prompts are taken literally (from the command line or decode.prompt_file) and must fit the context."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from decode.chains.baselines import autoregressive
from decode.engine.chain import Chain
from decode.engine.errors import DecodeError
from decode.engine.levels import ModelLevel, NgramLevel
from decode.generate import check_context, shorthand
from decode.settings import decoding_of, generate_of
from decode.engine.sampling import Sampling, SamplingError
from decode_fixtures import tiny_model

ROOT = Path(__file__).resolve().parents[2]
BAD_SAMPLING = [
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 2.0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": -1.0}, r"temperature must be >= 0"),
    ({"top_k": -5}, r"top_k must be >= 0"),
    ({"top_k": 2.5}, r"top_k must be an integer"),
    ({"temperature": float("nan")}, r"temperature must be a finite number"),
    ({"top_p": "0.9"}, r"top_p must be a finite number"),
]


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize

    with initialize(version_base="1.3", config_path="../../conf"):
        return hydra_compose("config", overrides=list(overrides))


@pytest.mark.parametrize("kwargs, message", BAD_SAMPLING)
def test_sampling_refuses_settings_that_define_no_distribution(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        Sampling(**kwargs)


def test_sampling_accepts_the_usual_settings():
    assert Sampling(0.0, 0, 1.0).greedy and not Sampling(0.7, 50, 0.9).greedy
    assert Sampling(1, 0, 1).top_p == 1


@pytest.fixture
def chain(one_thread):
    model = tiny_model(layers=2)
    return Chain([ModelLevel("target", model), NgramLevel("lookup", draft={"length": 4})]), model


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "8"])
def test_chain_and_ar_refuse_a_token_budget_below_one(chain, n):
    chain, model = chain
    with pytest.raises(DecodeError, match=r"max_new_tokens must be an integer >= 1"):
        chain.generate([1, 2, 3], n)
    with pytest.raises(DecodeError, match=r"max_new_tokens must be an integer >= 1"):
        autoregressive(model, [1, 2, 3], n)


@pytest.mark.parametrize("kwargs, message", BAD_SAMPLING + [({"seed": "x"}, "seed must be an integer or null")])
def test_bad_sampling_is_a_decode_error_before_any_chain_runs(kwargs, message):
    with pytest.raises(DecodeError, match=message):
        Sampling(**kwargs)


@pytest.mark.parametrize("override, message", [
    ("decode.top_p=0", r"^decode\.top_p must be in \(0, 1\]"),
    ("decode.top_p=2", r"^decode\.top_p must be in \(0, 1\]"),
    ("decode.temperature=-1", r"^decode\.temperature must be >= 0"),
    ("decode.top_k=-5", r"^decode\.top_k must be >= 0"),
    ("decode.temperature=warm", r"^decode\.temperature must be a finite number, got 'warm'"),
    ("decode.seed=1.5", r"^decode\.seed must be an integer or null"),
])
def test_config_sampling_values_are_refused_naming_the_key(override, message):
    with pytest.raises(DecodeError, match=message) as err:
        decoding_of(compose(override))
    assert "\n" not in str(err.value)


def test_config_sampling_values_pass_through():
    assert decoding_of(compose("decode.temperature=1", "decode.top_k=5", "decode.top_p=0.5")).sampling == Sampling(
        temperature=1.0, top_k=5, top_p=0.5, seed=0)


@pytest.mark.parametrize("value", ["0", "-1", "'12'", "null"])
def test_config_token_budget_is_refused_naming_the_key(value):
    with pytest.raises(DecodeError, match=r"^decode\.max_new_tokens must be an integer >= 1"):
        generate_of(compose(f"decode.max_new_tokens={value}", "decode.prompt=hi"))


NASTY = ["${HOME}", "${oc.env:HOME}", "${", "${a b}", "ends with a backslash \\", "\\", "\\\\", "it's", "\\'",
         "a\\'b\\\\'c\\", "\\${HOME}", "commas, = [x] {y}", 'say "hi"', "line\nbreak", "null", "42", "  padded  "]


@pytest.mark.parametrize("text", NASTY)
def test_prompt_shorthand_is_taken_literally(text):
    assert generate_of(compose(shorthand("prompt=" + text))).prompt == text


def test_prompt_file_is_read_literally(tmp_path):
    path = tmp_path / "prompt.txt"
    text = "Explain ${HOME} and %PATH% \\n\u2028 in C:\\dir\\\nSecond line ends with \\"
    path.write_bytes(b"\xef\xbb\xbf" + (text + "\n").encode())
    assert generate_of(compose(f"decode.prompt_file={path}")).prompt == text


def test_prompt_file_dash_reads_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("from stdin: ${x} \\\r\n".encode())))
    assert generate_of(compose("decode.prompt_file=-")).prompt == "from stdin: ${x} \\"


@pytest.mark.parametrize("content, overrides, message", [
    (b"\xff\xfe bad", (), r"decode.prompt_file=.*: not UTF-8 text \(byte 1\)"),
    (b"\n", (), r"decode.prompt_file=.*: no prompt in it \(empty\)"),
    (b"fine", ("decode.prompt=also",), r"decode.prompt and decode.prompt_file are both set"),
    (None, (), r"decode.prompt_file=.*missing.txt: cannot read \(No such file"),
])
def test_bad_prompt_files_are_one_line_errors(tmp_path, content, overrides, message):
    path = tmp_path / ("missing.txt" if content is None else "prompt.txt")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DecodeError, match=message) as err:
        generate_of(compose(f"decode.prompt_file={path}", *overrides)).prompt
    assert "\n" not in str(err.value)


def test_a_direct_interpolation_that_cannot_resolve_is_one_line():
    with pytest.raises(DecodeError, match=r"decode.prompt: cannot resolve it .*prompt_file"):
        generate_of(compose("decode.prompt=${nowhere}")).prompt


def test_prompt_longer_than_the_context_is_refused():
    model = tiny_model(layers=1)  # max_position_embeddings 1024
    check_context(list(range(1000)), 24, model)
    with pytest.raises(DecodeError, match=r"the prompt is 1,000 tokens; with decode.max_new_tokens=25 it needs 1,025 "
                                          r"positions, more than the model's context of 1,024"):
        check_context(list(range(1000)), 25, model)
    with pytest.raises(DecodeError, match=r"shorten the prompt$"):
        check_context(list(range(5000)), 1, model)


def test_generate_cli_refuses_bad_settings_before_loading_anything(tmp_path):
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "decode.generate", "prompt=${HOME} \\", "decode.top_p=0",
                           f"run_dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: decode.top_p must be in (0, 1] (1 = off), got 0.0"
