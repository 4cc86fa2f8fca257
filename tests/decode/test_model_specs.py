"""Which model specs go to the hub: only hub ids; a missing local folder such as runs/w4 says it is missing."""
from __future__ import annotations

import pytest

from infra.layout import RunLayout
from data.models import ModelSourceError, is_hub_id, load_model, resolve_model_path
from decode.chains.build import level_model
from decode.engine.spec import LevelSpec
from decode.engine.errors import DecodeError
from decode_fixtures import tiny_model


@pytest.mark.parametrize("name, hub", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/name.v2", True), ("a/b", True),
    ("runs", False), ("a/b/c", False), ("./a/b", False), ("/abs/path", False), ("~/models", False),
    ("org/", False), ("/name", False), ("-org/name", False), ("org/name-", False), ("org/na--me", False),
    ("org/na..me", False), ("org/na me", False), ("org/" + "x" * 97, False),
])
def test_hub_id_shape(name, hub):
    assert is_hub_id(name) is hub


def test_missing_folder_under_an_existing_local_folder_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ModelSourceError, match=r"^runs/w4: no such model folder \(runs/ exists here, so this is read "
                                               r"as a local path; hf:runs/w4 names the hub model\)$"):
        load_model("runs/w4")


def test_hub_ids_still_go_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("some-org/some-model") == "some-org/some-model"
    (tmp_path / "some-org").mkdir()
    assert resolve_model_path("hf:some-org/some-model") == "some-org/some-model"
    with pytest.raises(ModelSourceError, match="not a hub id"):
        resolve_model_path("hf:just-a-name")


@pytest.mark.parametrize("spec", ["a/b/c", "./w4", "w4/", "~/nope-polyspec-model", "org/na--me"])
def test_other_missing_paths_say_so_in_one_line(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="no such model folder") as err:
        resolve_model_path(spec)
    assert "\n" not in str(err.value)


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not an HF model folder"):
        resolve_model_path(str(tmp_path / "model.bin"))


@pytest.mark.parametrize("spec, missing", [("w4", "{run}/w4"), ("sub/w4", "{run}/sub/w4"), ("runs/w4", "runs/w4")])
def test_chain_level_names_the_missing_folder(tmp_path, monkeypatch, spec, missing):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "runs" / "default"
    (run / "sub").mkdir(parents=True)
    target = tiny_model(layers=1)
    with pytest.raises(DecodeError, match="no such model folder") as err:
        level_model(LevelSpec(name="w4", model=spec), target, None, RunLayout(run), "float32")
    assert missing.format(run=run) in str(err.value) and "hub" not in str(err.value).split("(")[0]
