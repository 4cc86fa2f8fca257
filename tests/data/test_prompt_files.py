"""Spec-Bench prompt files: odd but valid files load; bad ones are one-line DataErrors naming the line."""
from __future__ import annotations

import json

import pytest

from data.prompts import load_questions
from data.sharegpt import DataError


def line(qid=1, turns=("What is 2 + 2?",), category="math") -> str:
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)}, ensure_ascii=False)


def test_bom_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (line(1) + "\r\n" + line(2) + "\r\n").encode())
    assert [q.question_id for q in load_questions(path)] == [1, 2]


def test_unicode_line_separators_inside_a_turn_do_not_split_the_line(tmp_path):
    path = tmp_path / "q.jsonl"
    text = "first\u2028second\u2029third\x0cfourth\x85fifth"
    path.write_text(line(1, (text,)) + "\n" + line(2), encoding="utf-8")
    questions = load_questions(path)
    assert len(questions) == 2 and questions[0].turns == (text,)


@pytest.mark.parametrize("content, message", [
    (line(1).encode() + b"\n" + line(2).encode().replace(b"What", b"Wh\xe9t"), r"q.jsonl:2: not UTF-8 text"),
    ((line(1) + "\n" + line(2, ("bad \\ud800 turn",)).replace("\\\\ud800", "\\ud800")).encode(),
     r"q.jsonl:2: .*lone surrogate"),
    (("[" * 100_000 + "]" * 100_000).encode(), r"q.jsonl:1: not a Spec-Bench question \(nested too deeply\)"),
    (('{"question_id": ' + "1" * 5000 + ', "turns": ["x"]}').encode(), r"q.jsonl:1: .*ValueError: Exceeds the limit"),
    (line(qid=[1]).encode(), r"q.jsonl:1: .*'question_id' must be a string or an integer"),
    (line(category=7).encode(), r"q.jsonl:1: .*'category' must be a string"),
    (b"[1, 2]", r"q.jsonl:1: .*not a JSON object"),
    (b"{not json", r"q.jsonl:1: not a Spec-Bench question \(JSONDecodeError"),
    (b"\n\n", r"q.jsonl: no questions"),
])
def test_bad_prompt_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "q.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        load_questions(path)
    assert "\n" not in str(err.value)


def test_a_folder_is_not_a_question_file(tmp_path):
    with pytest.raises(DataError, match="a folder, not a question file"):
        load_questions(tmp_path)


@pytest.mark.parametrize("per_category", [0, -1, "2", True])
def test_per_category_must_be_a_positive_integer(per_category):
    with pytest.raises(DataError, match="per_category must be null or an integer >= 1"):
        load_questions(None, per_category)


def test_default_set_still_loads():
    questions = load_questions()
    assert len(questions) == 24 and len(load_questions(None, 1)) == 6
