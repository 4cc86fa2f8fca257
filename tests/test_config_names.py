"""Config names are code names: every section of the shipped configs that a stage reads becomes a dataclass whose fields
are its keys, one for one (infra.schema.parse refuses a key no field has; here, every field is also a key a user sees
in conf/, and decode.*, read key by key beside its bench, costs and chains, keeps no key nothing reads)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import infra.schema as schema
from data.settings import data_of, model_of, prepare_of
from decode.settings import DecodeSection, bench_of, costs_of, eval_of, generate_of, interop_of
from quantize.settings import kernels_of, w4_of
from train.settings import of as train_of

CONF = Path(__file__).resolve().parents[1] / "conf"
READERS = (data_of, model_of, prepare_of, generate_of, eval_of, bench_of, costs_of, interop_of, w4_of, kernels_of,
           train_of)
DECODE_SUBSECTIONS = {"bench", "costs", "chains"}  # decode.* keys with readers of their own
CHAIN_LEVELS = ("draft_defaults",)  # a chain's levels and drafts name only what they set (decode/engine/spec.py)


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def parsed_sections(cfg, monkeypatch) -> dict[str, tuple[type, set[str]]]:
    """{key path: (the dataclass, the keys its section had)} of every section the stages' readers parse from `cfg`."""
    seen, parse = {}, schema.parse

    def recording(cls, raw, where, *args, **kwargs):
        if isinstance(raw, dict) and ".chains." not in where:  # a level's keys: those it sets
            seen[where] = (cls, set(raw))
        return parse(cls, raw, where, *args, **kwargs)

    monkeypatch.setattr(schema, "parse", recording)
    for read in READERS:
        read(cfg)
    return seen


@pytest.mark.parametrize("train", ["eagle", "eagle3", "eagle_long", "gpu"])
def test_every_section_a_stage_reads_has_a_field_for_each_key_and_a_key_for_each_field(train, monkeypatch):
    sections = parsed_sections(composed(f"train={train}", "decode.prompt=hello"), monkeypatch)
    assert {"train", "quantize", "decode", "decode.bench", "decode.costs", "eval", "interop"} <= set(sections)
    unshown = {where: sorted(fields - keys) for where, (cls, keys) in sections.items()
               if not where.endswith(CHAIN_LEVELS) and (fields := {f.name for f in dataclasses.fields(cls)}) - keys}
    assert unshown == {}, f"fields with no key in conf/ (a setting no user sees): {unshown}"


def test_decode_keeps_no_key_nothing_reads():
    """decode.* is read key by key (its bench, costs and chains by their own readers): a key no field holds would be
    ignored without a word, so none may be there."""
    decode = set(composed().decode)
    assert decode - DECODE_SUBSECTIONS == {f.name for f in dataclasses.fields(DecodeSection)}
