"""Unreadable ShareGPT input never silently drops valid records and never ends in a traceback:
a broken record is skipped and counted, decoding resumes at the next record; odd encodings and
absurd values are one-line errors or counted skips; cut conversations are a counted warning."""
from __future__ import annotations

import json
import warnings

import pytest

from data.sharegpt import (
    Conversation, DataError, TokenizedConversation, Turn, decode_records, load_conversations, tokenize_conversation,
    warn_truncated,
)


def record(i: int, text: str = "") -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {{x}} in f() {{ return x; }}? {text}"},
        {"from": "gpt", "value": f"Answer {i}."},
    ]}


def array(n: int = 53, indent: int | None = None) -> str:
    return json.dumps([record(i) for i in range(n)], indent=indent)


def corrupt(text: str, at: str, replacement: str) -> str:
    i = text.index(at)
    return text[:i] + replacement + text[i + len(at):]


def ids(records) -> list[str]:
    return [r["id"] for r in records if isinstance(r, dict)]


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("at, replacement", [
    ('"c3"', '"c3" "stray"'),                                # missing comma
    ('"Question 3:', '"Question 3: \\q'),                    # invalid escape
    ('"value": "Question 3', '"value: "Question 3'),        # missing quote (string parity flips)
    ('"c3"', "1" * 5000),                                    # an integer beyond Python's digit limit
    ('"c3"', "[" * 100_000 + "]" * 100_000),                 # nesting beyond the recursion limit
    ('"c3"', "NaNx"),                                        # garbage
])
def test_one_broken_record_loses_only_itself(tmp_path, indent, at, replacement):
    text = corrupt(array(53, indent), at, replacement)
    records, unreadable = decode_records(text, "x")
    assert ids(records) == [f"c{i}" for i in range(53) if i != 3] and unreadable == 1
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=r"kept 52 of 53 records; skipped 1: 1 unreadable JSON"):
        assert len(load_conversations(str(path))) == 52


def test_several_broken_records_are_each_skipped_and_counted():
    text = corrupt(corrupt(array(), '"c3"', '"c3" x'), '"c40"', '"c40" x')
    text = corrupt(text, '"c41"', '"c41" y')  # two neighbours broken
    records, unreadable = decode_records(text, "x")
    assert ids(records) == [f"c{i}" for i in range(53) if i not in (3, 40, 41)] and unreadable == 3


def test_unclosed_structure_at_the_end_is_one_lost_record():
    records, unreadable = decode_records(array(5)[:-1] + ', {"id": "deep", "conversations": ' + "[" * 100_000, "x")
    assert ids(records) == [f"c{i}" for i in range(5)] and unreadable == 1


def test_nothing_recoverable_after_the_error_is_said_loudly_with_a_count():
    # a mangled tail: from record 3 on every record is broken, so decoding never resynchronises
    text = array(10)
    cut = text.index('{"id": "c3"')
    text = text[:cut] + text[cut:].replace('"id": ', '"id" ')
    with pytest.warns(UserWarning, match=r"nothing after it could be recovered: about 7 records"):
        records, unreadable = decode_records(text, "x")
    assert ids(records) == ["c0", "c1", "c2"] and unreadable == 7


def test_truncated_tail_still_counts_one():
    text = array(5)
    records, unreadable = decode_records(text[: text.index('"c4"') + 10], "x")
    assert ids(records) == ["c0", "c1", "c2", "c3"] and unreadable == 1


def test_bom_is_accepted_in_json_and_jsonl(tmp_path):
    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + array(3).encode())
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(record(i)) for i in range(3)).encode())
    for name in ("a.json", "a.jsonl"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(load_conversations(str(tmp_path / name))) == 3


def test_jsonl_is_split_on_newlines_only(tmp_path):
    lines = [json.dumps(record(i, text="a\u2028b\u2029c\x0cd\x1ce\x85f"), ensure_ascii=False) for i in range(3)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convs = load_conversations(str(tmp_path / "a.jsonl"))
    assert len(convs) == 3 and "a\u2028b\u2029c" in convs[0].turns[0].text


def test_non_utf8_bytes_skip_only_their_records(tmp_path):
    good = [json.dumps(record(i)).encode() for i in range(4)]
    bad = json.dumps(record(9)).encode().replace(b"Question", b"Quest\xff\xfeion")
    (tmp_path / "a.jsonl").write_bytes(b"\n".join([good[0], bad, *good[1:]]))
    (tmp_path / "a.json").write_bytes(b"[" + b", ".join([good[0], bad, *good[1:]]) + b"]")
    for name in ("a.jsonl", "a.json"):
        with pytest.warns(UserWarning, match=r"kept 4 of 5 records; skipped 1: 1 text not valid UTF-8"):
            assert [c.id for c in load_conversations(str(tmp_path / name))] == ["c0", "c1", "c2", "c3"]


def test_lone_surrogate_escapes_are_a_counted_skip(tmp_path):
    lines = [json.dumps(record(0)), json.dumps(record(1)).replace("Question", "Quest\\ud800ion"),
             json.dumps({"id": "\\udfff", **{k: v for k, v in record(2).items() if k != "id"}})
             .replace("\\\\udfff", "\\udfff")]
    (tmp_path / "a.jsonl").write_text("\n".join(lines))
    with pytest.warns(UserWarning, match=r"kept 1 of 3 records; skipped 2: 2 text not valid UTF-8"):
        assert [c.id for c in load_conversations(str(tmp_path / "a.jsonl"))] == ["c0"]


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000, '{"id": ' + "9" * 5000 + "}"])
def test_absurd_jsonl_lines_are_counted_not_fatal(tmp_path, line):
    (tmp_path / "a.jsonl").write_text("\n".join([json.dumps(record(0)), line, json.dumps(record(1))]))
    with pytest.warns(UserWarning, match="1 unreadable JSON"):
        assert len(load_conversations(str(tmp_path / "a.jsonl"))) == 2


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe[\x00{\x00", "not UTF-8 text"),  # UTF-16
    (b"\x00\x01\x02", "not a JSON array"),
])
def test_unreadable_files_are_one_line_errors(tmp_path, content, message):
    (tmp_path / "a.json").write_bytes(content)
    with pytest.raises(DataError, match=message) as err:
        load_conversations(str(tmp_path / "a.json"))
    assert "\n" not in str(err.value)


def test_a_file_of_only_broken_records_says_how_many(tmp_path):
    (tmp_path / "a.jsonl").write_text("{x\n{y\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error alone says it all: one line, no warning before it
        with pytest.raises(DataError, match=r"no valid ShareGPT conversation found \(2 unreadable JSON\)"):
            load_conversations(str(tmp_path / "a.jsonl"))


class CharTokenizer:
    """One token per character, offsets included; a minimal chat template."""

    name_or_path = "chars"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return ("".join(f"<{m['role']}>{m['content']}|" for m in messages)
                + ("<assistant>" if add_generation_prompt else ""))

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [ord(c) % 1000 for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_a_megabyte_turn_is_cut_with_a_counted_warning():
    tok = CharTokenizer()
    convs = [Conversation("short", (Turn("user", "hi"), Turn("assistant", "hello"))),
             Conversation("huge", (Turn("user", "x" * 1_000_000), Turn("assistant", "ok")))]
    out = [tokenize_conversation(tok, c, 64) for c in convs]
    assert [len(t.input_ids) for t in out] == [len(tok.apply_chat_template(convs[0].messages())), 64]
    assert out[1].full_length > 1_000_000
    with pytest.warns(UserWarning, match=r"1 of 2 conversations are longer than data.max_len=64 tokens and were cut "
                                         r"\(longest: 1,000,\d+ tokens\); 1 of them kept no assistant token"):
        assert warn_truncated(out, 64) == 1


def test_load_tokenized_warns_about_cut_conversations(tmp_path):
    from data.settings import DataSettings
    from data.sharegpt import load_tokenized

    records = [record(i) for i in range(6)] + [{"id": "long", "conversations": [
        {"from": "human", "value": "y" * 5000}, {"from": "gpt", "value": "fine"}]}]
    (tmp_path / "a.json").write_text(json.dumps(records))
    data = DataSettings(source=str(tmp_path / "a.json"), max_len=200, held_out_fraction=0.0, max_conversations=None)
    with pytest.warns(UserWarning, match=r"1 of 7 conversations are longer than data.max_len=200"):
        train, held_out = load_tokenized(data, CharTokenizer())
    assert len(train) == 6 and not held_out  # the cut one kept no assistant token
    assert isinstance(train[0], TokenizedConversation)
