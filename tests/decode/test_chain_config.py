"""Chains come from config: every shipped chain parses, and bad levels fail with one clear line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from decode_fixtures import tiny_model
from test_native_w4 import w4_folder  # noqa: F401
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from decode.chains.build import builder_for
from decode_fixtures import build_chain
from decode.settings import decoding_of
from decode.engine.chain import read_features
from decode.engine.errors import DecodeError
from decode.engine.levels import EagleLevel, ModelLevel, NgramLevel
from infra.layout import RunLayout

CONF = Path(__file__).resolve().parents[2] / "conf"
VOCAB = 300


def word_tokenizer(prefix: str) -> PreTrainedTokenizerFast:
    vocab = {f"{prefix}{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token=f"{prefix}0")))


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, vocab=VOCAB), word_tokenizer("w")


def saved_level(tmp_path: Path, prefix: str) -> str:
    folder = tmp_path / f"level_{prefix}"
    tiny_model(seed=1, vocab=VOCAB).save_pretrained(folder)
    word_tokenizer(prefix).save_pretrained(folder)
    return str(folder)


def test_shipped_chains_are_well_formed():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_dir=/tmp/unused"])
    chains = OmegaConf.to_container(cfg.decode.chains, resolve=True)
    assert {"dualistic", "polybasic", "standin2", "standin3"} <= set(chains)
    for name, levels in chains.items():
        assert levels[0]["kind"] == "model" and levels[0]["model"] == "target", name
        assert all(level["kind"] in ("model", "eagle", "ngram") for level in levels), name
    assert cfg.decode.bench.two_level in chains and cfg.decode.bench.three_level in chains
    assert len(chains[cfg.decode.bench.three_level]) == 3


def test_levels_built_from_config(target, tmp_path):
    model, tokenizer = target
    chain = build_chain([
        {"kind": "model", "name": "t"},
        {"kind": "model", "name": "same_vocab", "model": saved_level(tmp_path, "w"), "mu": 2},
        {"kind": "model", "name": "exit", "model": "target", "layers": 2, "mu": 3},
        {"kind": "ngram", "name": "lookup", "max_ngram": 2, "draft": {"mode": "chain", "length": 3}},
    ], model, tokenizer)
    kinds = [type(level) for level in chain.levels]
    assert kinds == [ModelLevel, ModelLevel, ModelLevel, NgramLevel]
    assert [level.mu for level in chain.levels[:3]] == [1, 2, 3]
    exit_model = chain.levels[2].model
    assert len(exit_model.get_decoder().layers) == 2 and len(model.get_decoder().layers) == 4
    assert exit_model.get_decoder().layers[0] is model.get_decoder().layers[0]  # shared, not copied
    assert chain.generate([1, 2, 3, 1, 2], 12).stats.new_tokens == 12


def test_eagle_level_from_config(target):
    model, tokenizer = target
    chain = build_chain([{"kind": "model"}, {"kind": "eagle", "path": "untrained"}], model, tokenizer,
                        draft_defaults={"chain": {"length": 3}})
    assert isinstance(chain.levels[1], EagleLevel) and chain.levels[0].keep_hidden
    assert chain.levels[1].draft_spec.as_config() == {"mode": "chain", "length": 3}


def test_feature_levels_must_keep_hidden_states_from_construction(target):
    model, _ = target
    with pytest.raises(DecodeError, match="levels t do not keep their hidden states"):
        read_features([ModelLevel("t", model)], model.config.hidden_size, model.dtype)


@pytest.mark.parametrize("levels, message", [
    ([], "empty chain"),
    ([{"kind": "model"}], "at least two levels"),
    ([{"kind": "ngram"}, {"kind": "model"}], "level 1 must be the target"),
    ([{"kind": "model"}, {"kind": "lstm"}], "kind must be one of model, eagle, ngram, got 'lstm'"),
    ([{"kind": "model"}, {"kind": "ngram"}, {"kind": "ngram"}], "only models verify"),
    ([{"kind": "model"}, {"kind": "model", "model": "target", "mu": 0}, {"kind": "ngram"}], "mu must be >= 1"),
    ([{"kind": "model"}, {"kind": "model", "model": "target", "draft": {"mode": "tree"}}, {"kind": "ngram"}],
     "only the last level can draft a tree"),
    ([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 9}], "layers must be between 1 and 3"),
    ([{"kind": "model"}, {"kind": "eagle", "path": "no_such_head"}], "no EAGLE head folder"),
    ([{"kind": "model"}, {"kind": "eagle", "path": "untrained", "features": "w7"}],
     "features must be one of nearest, target, got 'w7'"),
    ([{"kind": "model"}, {"kind": "ngram", "draft": {"mode": "tree", "depth": 2}}],
     "a tree draft needs top_k, total_tokens"),
    ([{"kind": "model"}, {"kind": "ngram", "draft": {"mode": "trees", "length": 2}}],
     "mode must be one of chain, tree, got 'trees'"),
])
def test_bad_chains_fail_with_one_line(target, levels, message):
    model, tokenizer = target
    with pytest.raises(DecodeError) as err:
        build_chain(levels, model, tokenizer, RunLayout(Path("/nonexistent-run")))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_level_with_other_vocabulary_is_refused(target, tmp_path):
    model, tokenizer = target
    folder = saved_level(tmp_path, "x")
    with pytest.raises(DecodeError, match="different vocabulary") as err:
        build_chain([{"kind": "model"}, {"kind": "model", "name": "foreign", "model": folder}], model, tokenizer)
    assert "\n" not in str(err.value)


def test_relative_level_folder_resolves_against_run_dir(target, tmp_path):
    model, tokenizer = target
    saved = Path(saved_level(tmp_path, "w"))
    saved.rename(tmp_path / "w4")
    chain = build_chain([{"kind": "model"}, {"kind": "model", "model": "w4", "draft": {"length": 4}}], model, tokenizer,
                        RunLayout(tmp_path))
    assert chain.levels[1].model is not model


def test_configured_outputs_are_where_chains_and_the_eval_look(target, tmp_path):
    """quantize.output and train.output moved out of the run dir: `model: w4` and `path: eagle` follow them,
    in the builder and in the eval's bundle (infra/layout.py)."""
    from data.models import weights_hash
    from heads.eagle import EagleHead
    from decode.publish.bundle import level_folder

    model, tokenizer = target
    w4, head = tmp_path / "elsewhere" / "quantized", tmp_path / "heads" / "first"
    w4.parent.mkdir()
    Path(saved_level(tmp_path, "w")).rename(w4)
    EagleHead.for_target(model).save_pretrained(head, target_hash=weights_hash(model), tokenizer=tokenizer)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"run_dir={tmp_path / 'run'}", f"quantize.output={w4}",
                                                       f"train.output={head}", "decode.fast=false"])
    levels = [{"kind": "model"}, {"kind": "model", "name": "w4", "model": "w4"}, {"kind": "eagle", "path": "eagle"}]
    decoding = decoding_of(cfg)
    chain = builder_for(decoding, model, tokenizer).build(decoding.parse_chain(levels))
    assert weights_hash(chain.levels[1].model) == weights_hash(tiny_model(seed=1, vocab=VOCAB))
    assert isinstance(chain.levels[2], EagleLevel) and chain.levels[1].keep_hidden
    # the draft from config
    assert chain.levels[2].draft_spec.as_config() == {"mode": "chain", **cfg.decode.draft_defaults.chain}
    assert [level_folder(level, decoding.layout) for level in levels] == [None, w4, head]


def test_a_chain_reports_a_damaged_head_in_one_line(target, tmp_path):
    from data.models import weights_hash
    from heads.eagle import EagleHead

    model, _ = target
    out = EagleHead.for_target(model).save_pretrained(tmp_path / "eagle", target_hash=weights_hash(model))
    (out / "model.safetensors").write_bytes(b"")

    with pytest.raises(DecodeError, match="cannot load the EAGLE head") as err:
        build_chain([{"kind": "model"}, {"kind": "eagle", "path": str(out)}], model, None, RunLayout(tmp_path))
    assert "\n" not in str(err.value) and "unreadable" in str(err.value)


def test_chain_config_builds_an_eagle3_level_and_checks_the_aux_layers(tmp_path):
    import torch

    from data.models import weights_hash
    from heads.eagle3 import Eagle3Head

    model = tiny_model(seed=0, vocab=VOCAB, layers=6)  # aux layers (2, 3, 3) by vLLM's default rule
    out = Eagle3Head.for_target(model, draft_vocab=torch.arange(0, VOCAB, 2)).save_pretrained(
        tmp_path / "e3", target_hash=weights_hash(model))
    chain = build_chain([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 4, "mu": 2},
                         {"kind": "eagle", "path": str(out), "draft": {"length": 3}}], model, tokenizer=None)
    assert chain.levels[-1].head.method == "eagle3" and all(level.keep_hidden == (2, 3, 3)
                                                            for level in chain.levels[:2])
    assert len(chain.generate([5, 6, 7, 8, 9], 12).tokens) == 12
    with pytest.raises(DecodeError, match=r"states entering layers \[2, 3, 3\], but this level's model has 3"):
        build_chain([{"kind": "model"}, {"kind": "model", "model": "target", "layers": 3},
                     {"kind": "eagle", "path": str(out)}], model, tokenizer=None)
    with pytest.raises(DecodeError, match="an eagle3 head, not an eagle one"):
        build_chain([{"kind": "model"}, {"kind": "eagle", "path": str(out), "method": "eagle"}], model, tokenizer=None)


def test_generate_cli_reports_bad_input_in_one_line():
    out = subprocess.run([sys.executable, "-m", "decode.generate", "chain=polybasic"], capture_output=True, text=True,
                         cwd=CONF.parent,
                         env={"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
                         timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == 'error: no prompt: python -m decode.generate prompt="your question"'


def test_a_w4_level_loads_with_gptqmodels_output_in_the_log(w4_folder, tiny_source, tmp_path, capfd):  # noqa: F811
    """GPTQModel prints its kernel choice and format conversions at every load: in the run's library log, not on the
    terminal, unless the run is verbose (no log)."""
    from data.models import load_model
    from decode.backends import Backend
    from decode.chains.build import ChainBuilder, LevelSettings
    from decode.engine.spec import ChainSpec

    target, tokenizer = load_model(str(tiny_source))
    spec = ChainSpec.parse([{"kind": "model"}, {"kind": "model", "name": "w4", "model": str(w4_folder),
                                                        "draft": {"mode": "chain", "length": 2}}])
    log = tmp_path / "library_logs" / "decode.log"
    capfd.readouterr()
    ChainBuilder(target, tokenizer, settings=LevelSettings(backend=Backend(), chatter=log)).build(spec)
    terminal = "".join(capfd.readouterr())
    assert "Kernel: selected" in log.read_text() and "Kernel: selected" not in terminal, terminal[-2000:]
    ChainBuilder(target, tokenizer, settings=LevelSettings(backend=Backend())).build(spec)
    assert "Kernel: selected" in "".join(capfd.readouterr())
