"""ShareGPT input: recovery of the truncated bundled file, counted skips of malformed records, the mask."""
from __future__ import annotations

import json

import pytest

from data.sharegpt import (
    Conversation, DataError, Turn, decode_records, load_conversations, split_conversations, tokenize_conversation,
)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_truncated_array_keeps_every_complete_record():
    records, broken = decode_records('[{"id": 1}, {"id": 2}, {"id": 3, "conv', "x")
    assert records == [{"id": 1}, {"id": 2}] and broken == 1


def test_malformed_records_are_skipped_and_counted(tmp_path):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    bad = [
        {"id": "empty", "conversations": []},
        {"id": "emptyturn", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "x"}]},
        {"id": "role", "conversations": [{"from": "alien", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        {"id": "type", "conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x"}]},
        {"id": "first", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},
        "not an object",
    ]
    path = _write(tmp_path, "mixed.json", json.dumps([good, *bad]))
    with pytest.warns(UserWarning, match=r"kept 1 of 7 records; skipped 6") as caught:
        convs = load_conversations(path)
    message = str(caught[0].message)
    for reason in ("empty turn", "unknown role 'alien'", "non-string role or value", "does not start with the user",
                   "no conversation"):
        assert reason in message
    assert [c.id for c in convs] == ["ok"]


def test_broken_json_lines_are_counted_not_fatal(tmp_path):
    good = json.dumps({"id": "a",
                       "conversations": [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]})
    path = _write(tmp_path, "data.jsonl", good + "\n{not json\n" + good.replace('"a"', '"b"', 1) + "\n")
    with pytest.warns(UserWarning, match="1 unreadable JSON"):
        convs = load_conversations(path)
    assert len(convs) == 2


def test_roles_are_normalised(tmp_path):
    record = {"id": "r", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "user", "value": "q"}, {"from": "chatgpt", "value": "a"}]}
    (conv,) = load_conversations(_write(tmp_path, "r.json", json.dumps([record])))
    assert [t.role for t in conv.turns] == ["system", "user", "assistant"]


@pytest.mark.parametrize("content, problem", [
    ("", "not a JSON array"),
    ('{"id": 1}', "not a JSON array"),
    ("[]", "no valid ShareGPT conversation"),
])
def test_unusable_files_get_one_line_errors(tmp_path, content, problem):
    with pytest.raises(DataError, match=problem) as err:
        load_conversations(_write(tmp_path, "bad.json", content))
    assert "\n" not in str(err.value)


def test_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match="no such ShareGPT file"):
        load_conversations(str(tmp_path / "absent.json"))


def test_split_is_deterministic_and_disjoint(sharegpt_file):
    convs = load_conversations(str(sharegpt_file))
    train, held = split_conversations(convs, 0.25)
    train2, held2 = split_conversations(list(reversed(convs)), 0.25)
    assert {c.id for c in train} == {c.id for c in train2} and {c.id for c in held} == {c.id for c in held2}
    assert not {c.id for c in train} & {c.id for c in held} and held and train


@pytest.mark.slow
def test_bundled_file_recovers_every_complete_record():
    """The README's numbers: the truncated bundled array yields 17,671 complete records (its cut-off tail is
    one unreadable), 11,145 conversations; 389 of them repeat an earlier one and are kept, with a word."""
    from data.sharegpt import read_records

    records, broken = read_records("bundled")
    assert len(records) == 17_671 and broken == 1
    with pytest.warns(UserWarning) as said:
        convs = load_conversations("bundled")
    messages = [str(w.message) for w in said]
    assert any("kept 11145 of 17672 records" in m and "6320 does not start with the user" in m for m in messages)
    assert any("389 of the 11145 conversations kept repeat an earlier one" in m for m in messages)
    assert len(convs) == 11_145


@pytest.mark.slow
def test_assistant_mask_covers_exactly_the_replies(bundled_target):
    _, tokenizer = bundled_target
    conv = Conversation("m", (Turn("user", "Name a colour."), Turn("assistant", "Blue is a colour."),
                              Turn("user", "Another?"), Turn("assistant", "Green.")))
    tok = tokenize_conversation(tokenizer, conv, max_len=512)
    spans, current = [], []
    for token_id, m in zip(tok.input_ids, tok.loss_mask):
        if m:
            current.append(token_id)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [tokenizer.decode(s) for s in spans] == ["Blue is a colour.<|im_end|>", "Green.<|im_end|>"]
    truncated = tokenize_conversation(tokenizer, conv, max_len=10)
    assert len(truncated.input_ids) == len(truncated.loss_mask) == 10
