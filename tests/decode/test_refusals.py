"""What a model cannot do is refused before any model loads, in one line naming the setting to change: an early-exit
stand-in level deeper than the model (the shipped stand-ins cut to 8 and 12 layers; a user's model may have fewer)."""
from __future__ import annotations

import pytest
from hydra import compose, initialize

import decode.chains.build as build
from decode.engine.errors import DecodeError

STANDIN3 = r"decode\.chains\.standin3\.1\.layers=12: level 'exit12' is an early-exit copy of a model of 2 layers; " \
           r"set it between 1 and 1$"


def config(*overrides: str):
    with initialize(version_base="1.3", config_path="../../conf"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def no_model_loads(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(build, "load_target", refused)


def test_generate_refuses_a_stand_in_deeper_than_the_model(tiny_source, tmp_path, no_model_loads):
    from decode.generate import run
    from decode.settings import generate_of

    settings = generate_of(config(f"model.name={tiny_source}", f"run_dir={tmp_path}", "decode.chain=standin3",
                                  "decode.prompt=hi"))
    with pytest.raises(DecodeError, match=STANDIN3):
        run(settings)


def test_eval_names_the_decode_chain_its_chain_comes_from(tiny_source, tmp_path, no_model_loads):
    """eval=smoke's polybasic is decode.chains.standin3: that is the setting to change."""
    from decode.eval import run
    from decode.settings import eval_of

    settings = eval_of(config(f"model.name={tiny_source}", f"run_dir={tmp_path}", "eval=smoke"))
    with pytest.raises(DecodeError, match=STANDIN3):
        run(settings)


def test_the_named_setting_is_the_fix(tiny_source, tmp_path):
    from decode.settings import decoding_of

    decoding = decoding_of(config(f"model.name={tiny_source}", f"run_dir={tmp_path}",
                                  "decode.chains.standin3.1.layers=1"))
    build.refuse_unfit_layers(decoding.spec("standin3"), "decode.chains.standin3", str(tiny_source), decoding.layout)
    with pytest.raises(DecodeError, match=r"decode\.chains\.standin2\.1\.layers=8: .*between 1 and 1$"):
        build.refuse_unfit_layers(decoding.spec("standin2"), "decode.chains.standin2", str(tiny_source),
                                  decoding.layout)
