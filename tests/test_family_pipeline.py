"""Each family a user brings beside Llama's, through every stage as the apps run them, on a tiny random model:
train.eagle (an EAGLE-2 and an EAGLE-3 head) -> quantize.w4 -> decode.generate with chain=polybasic (target <- W4 <-
each head) and chain=w4_lookup, each printing "outputs identical" (equal to the target decoding alone). GPT-NeoX
decodes as `decode.backend=auto` does (the compiled runner, ahead of time, for every level but the native ones); the
other families on transformers' forward (`eager`): tests/decode/test_families.py decodes each on the compiled runner."""
from __future__ import annotations

from pathlib import Path

import pytest
from family_models import tiny_family_model

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "data.held_out_fraction=0.15", "train.max_conversations=16", "train.epochs=1", "train.micro_batch=2",
    "train.grad_accum=2", "train.checkpoint_every=100", "train.warmup_steps=2", "train.eval_every=0",
    "train.eval.conversations=3", "train.eval.gen_tokens=8", "train.eval.depth=3",
    "quantize.calibration.samples=8", "quantize.calibration.min_len=32", "quantize.calibration.batch_size=4",
    "quantize.eval.ppl_conversations=4", "quantize.eval.agreement_prompts=2", "quantize.eval.continuation_tokens=16",
    "quantize.eval.timing_repeats=1", "decode.max_new_tokens=48", "decode.prompt='the cat sat on a mat while blue'",
]


def compose(*overrides: str):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", [("mixtral", "eager"), ("qwen3_moe", "eager"), ("gpt_oss", "eager"),
                                             ("gpt_neox", "auto")])
def test_every_stage_runs_and_decodes_exactly(family, backend, chat_file, tmp_path, capsys):
    import train.eagle as eagle
    import train.settings as train_settings
    from decode.generate import run as generate
    from decode.settings import generate_of
    from quantize.settings import w4_of
    from quantize.w4 import run as quantize

    source = tiny_family_model(family, tmp_path / "source")
    common = [f"model.name={source}", f"data.source={chat_file}", f"run_dir={tmp_path / 'run'}",
              f"decode.backend={backend}", *SMALL]
    for method in ("eagle", "eagle3"):
        eagle.train(train_settings.of(compose(*common, f"train={method}")))
    quantize(w4_of(compose(*common)))
    capsys.readouterr()
    for chain, method in (("polybasic", "eagle"), ("polybasic", "eagle3"), ("w4_lookup", "eagle")):
        generate(generate_of(compose(*common, f"decode.chain={chain}", f"train={method}")))
        said = capsys.readouterr().out
        assert "outputs identical" in said, f"{family}, {chain} with the {method} head: {said[-600:]}"
