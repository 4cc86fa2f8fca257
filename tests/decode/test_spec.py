"""The chain spec: parsed once from config against its schema, frozen, and only ever replaced."""
from __future__ import annotations

import dataclasses

import pytest

from decode.engine.spec import ChainSpec, Draft, LevelSpec, SpecError, stacks

POLYBASIC = [{"kind": "model", "name": "target"},
             {"kind": "model", "name": "w4", "model": "w4", "mu": 1, "lm_head": "int8"},
             {"kind": "eagle", "name": "head", "draft": {"mode": "tree", "depth": 1, "top_k": 8, "total_tokens": 2}}]


def test_parse_fills_names_and_draft_defaults():
    spec = ChainSpec.parse([{"kind": "model"}, {"kind": "ngram", "draft": {"length": 3}}, ][:1] + [{"kind": "ngram"}],
                           {"chain": {"length": 4}, "tree": {"depth": 5, "top_k": 8, "total_tokens": 48}})
    assert [level.name for level in spec.levels] == ["L1", "L2"] and spec.drafter.draft == Draft("chain", length=4)
    tree = ChainSpec.parse([{}, {"kind": "ngram", "draft": {"mode": "tree", "top_k": 2}}],
                           {"tree": {"depth": 5, "top_k": 8, "total_tokens": 48}})
    assert tree.drafter.draft == Draft("tree", depth=5, top_k=2, total_tokens=48)  # the level's own key wins


@pytest.mark.parametrize("levels, message", [
    ([{"kind": "model"}, {"kind": "lstm"}], "chain level 2: kind must be one of model, eagle, ngram, got 'lstm'"),
    ([{"kind": "model"}, {"kind": "model", "mu": "2"}], "chain level 2: mu must be int, got '2'"),
    ([{"kind": "model"}, {"kind": "model", "mu": True}], "chain level 2: mu must be int, got True"),
    ([{"kind": "model"}, {"kind": "model", "moddel": "w4"}], "chain level 2: unknown key 'moddel'"),
    ([{"kind": "model"}, {"kind": "eagle", "draft": {"mode": "beam"}}],
     "chain level 2: draft: mode must be one of chain, tree"),
    ([{"kind": "model"}, {"kind": "model", "vocab": "all"}], "chain level 2: vocab must be one of head, got 'all'"),
    ([{"kind": "model", "layers": 3}, {"kind": "ngram"}], "level 1 must be the target"),
    ([{"name": "a"}, {"kind": "ngram", "name": "a"}], "level names must be unique"),
    ([], "empty chain"),
])
def test_schema_checks_are_one_line(levels, message):
    with pytest.raises(SpecError, match=message) as err:
        ChainSpec.parse(levels)
    assert "\n" not in str(err.value)


def test_spec_is_frozen_and_knobs_make_a_new_one():
    spec = ChainSpec.parse(POLYBASIC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.levels[1].mu = 4  # type: ignore[misc]
    planned = spec.with_knobs({"mu": {"w4": 3}, "draft": {"mode": "chain", "length": 2}})
    assert spec == ChainSpec.parse(POLYBASIC) and planned != spec
    assert planned.knobs() == {"mu": {"w4": 3}, "draft": {"mode": "chain", "length": 2}}
    assert planned.levels[1].lm_head == "int8" and planned.levels[0] is spec.levels[0]


def test_as_config_round_trips_and_keeps_only_the_kinds_keys():
    spec = ChainSpec.parse(POLYBASIC)
    config = spec.as_config()
    assert config[2] == {"kind": "eagle", "name": "head", "mu": 1, "path": "eagle",
                         "draft": {"mode": "tree", "depth": 1, "top_k": 8, "total_tokens": 2}}
    assert "path" not in config[1] and "max_ngram" not in config[1]
    assert ChainSpec.parse(config) == spec


def test_a_built_chain_leaves_its_spec_unchanged():
    from decode.chains.build import ChainBuilder
    from decode_fixtures import tiny_model

    spec = ChainSpec.parse([{"name": "t"}, {"kind": "model", "name": "exit", "layers": 2, "mu": 2},
                            {"kind": "ngram", "name": "n", "draft": {"length": 3}}])
    before = dataclasses.astuple(spec)
    builder = ChainBuilder(tiny_model(0), None)
    chain = builder.build(spec)
    chain.generate([1, 2, 3, 1, 2], 8)
    assert dataclasses.astuple(spec) == before and chain.levels[1].mu == 2
    again = builder.build(spec.with_knobs({"mu": {"exit": 1}, "draft": {"mode": "chain", "length": 1}}))
    assert again.levels[1].model is chain.levels[1].model  # loaded once, shared by every chain of the builder
    assert isinstance(spec.levels[1], LevelSpec)


DEFAULTS = {"chain": {"length": 4}}
DUALISTIC = POLYBASIC[:1] + POLYBASIC[2:]
LOOKUP = [{"kind": "model", "name": "target"}, {"kind": "ngram", "name": "lookup", "draft": {"length": 6}}]


def test_stacks_are_every_chain_the_levels_allow_but_the_configured_ones():
    configured = [ChainSpec.parse(levels, DEFAULTS) for levels in (DUALISTIC, POLYBASIC, LOOKUP)]
    found = {name: ChainSpec.parse(levels, DEFAULTS) for name, levels in stacks(configured).items()}
    assert list(found) == ["target<-w4", "target<-w4<-lookup"]  # head and lookup never verify; configured left out
    w4_drafts = found["target<-w4"].drafter
    assert w4_drafts.draft == Draft("chain", length=4) and w4_drafts.lm_head == "int8"  # the default draft
    assert found["target<-w4<-lookup"].levels[1] == configured[1].levels[1]  # the middle level as configured
    assert found["target<-w4<-lookup"].drafter == configured[2].drafter  # its own draft kept
    assert "target<-w4<-lookup" not in stacks(configured + [found["target<-w4<-lookup"]])


def test_stacks_skip_levels_whose_names_would_repeat():
    other_w4 = [{"kind": "model", "name": "target"}, {"kind": "model", "name": "w4", "model": "w4", "vocab": "head"},
                {"kind": "ngram", "name": "lookup"}]
    configured = [ChainSpec.parse(levels, DEFAULTS) for levels in (POLYBASIC, other_w4)]
    for name, levels in stacks(configured).items():
        assert [level["name"] for level in levels] == name.split("<-")
        ChainSpec.parse(levels, DEFAULTS)  # a valid chain: no two levels named w4


def test_a_levels_cost_row_names_the_model_and_the_lm_head_it_runs_with():
    """decode.costs times the W4 level with its fp32 LM head and with lm_head: int8; a chain's W4 level on int8 rows
    must not be planned on the fp32 head's row (113 MB a token against 28 MB), nor an early-exit copy on the whole
    model's."""
    assert LevelSpec(model="target").cost_row == "target"
    assert LevelSpec(model="w4").cost_row == "w4"
    assert LevelSpec(model="w4", lm_head="int8").cost_row == "w4 int8 head"
    assert LevelSpec(model="w4", vocab="head").cost_row == "w4 V=head"
    for none in (LevelSpec(model="target", layers=8), LevelSpec(model="w4", dtype="bfloat16"),
                 LevelSpec(model="/some/folder"), LevelSpec(kind="eagle"), LevelSpec(kind="ngram")):
        assert none.cost_row is None
