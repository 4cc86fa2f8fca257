"""ShareGPT files are streamed: recovery from damage is linear in the file's size and counts every record it
loses; any chunking of the text decodes the same records; memory stays bounded by a record, not the file."""
from __future__ import annotations

import json
import tracemalloc
import warnings

import pytest

from data.records import Buffer, LineReader, RecordReader, text_chunks
from data.sharegpt import decode_records, read_records


def record(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: what is {{x}} in f() {{ return x; }}? " + "word " * 30},
        {"from": "gpt", "value": f"Answer {i}. " + "more " * 50},
    ]}


def trailing_commas(i: int) -> str:
    """A record written by hand: a comma after its last member (JSON has none)."""
    return json.dumps(record(i), indent=1)[:-1] + ",}"


def repr_file(n: int) -> str:
    return repr([record(i) for i in range(n)])  # Python's repr: single quotes, not JSON


def trailing_file(n: int) -> str:
    return "[" + ",\n".join(trailing_commas(i) for i in range(n)) + "]"


def ids(records) -> list[str]:
    return [r["id"] for r in records]


@pytest.mark.parametrize("make", [repr_file, trailing_file])
def test_a_20_megabyte_damaged_file_is_read_and_every_record_counted(tmp_path, make):
    """Recovery counts every record of a large damaged file (its speed is a benchmark's business, not a test's)."""
    text, n = make(1), 0
    per_record = len(text)
    n = 20_000_000 // per_record
    path = tmp_path / "damaged.json"
    path.write_text(make(n))
    with pytest.warns(UserWarning, match=rf"nothing after it could be recovered: about {n:,} records"):
        records, unreadable = read_records(str(path))
    assert records == [] and unreadable == n


def test_trailing_commas_lose_exactly_their_records():
    parts = [json.dumps(record(i)) if i % 3 else trailing_commas(i) for i in range(30)]
    records, unreadable = decode_records("[" + ", ".join(parts) + "]", "x")
    assert ids(records) == [f"c{i}" for i in range(30) if i % 3] and unreadable == 10


def test_single_quoted_records_among_good_ones_are_each_counted():
    parts = [json.dumps(record(i)) if i % 4 else repr(record(i)) for i in range(40)]
    records, unreadable = decode_records("[" + ",\n".join(parts) + "]", "x")
    assert ids(records) == [f"c{i}" for i in range(40) if i % 4] and unreadable == 10


BROKEN = [
    ('"c3"', '"c3" "stray"'), ('"Question 3:', '"Question 3: \\q'), ('"value": "Question 3', '"value: "Question 3'),
    ('"c3"', "1" * 5000), ('"c3"', "[" * 5000 + "]" * 5000), ('"c3"', "NaNx"),
]


@pytest.mark.parametrize("at, replacement", BROKEN)
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_any_chunking_decodes_the_same_records(at, replacement, chunk):
    text = json.dumps([record(i) for i in range(12)], indent=1)
    text = text.replace(at, replacement, 1)
    whole = decode_records(text, "x")
    reader = RecordReader(Buffer(text_chunks(text, chunk)), "x")
    assert (list(reader), reader.unreadable) == whole
    assert whole[1] == 1 and len(whole[0]) == 11


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_numbers_and_literals_cut_by_a_chunk_are_not_damage(chunk):
    values = [{"id": "a", "conversations": [], "n": 1234567890.5e-3, "t": True, "f": False, "z": None}, 12345, -0.5e10]
    reader = RecordReader(Buffer(text_chunks(json.dumps(values), chunk)), "x", is_record=lambda r: True)
    assert list(reader) == values and reader.unreadable == 0


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_json_lines_in_any_chunking(chunk):
    lines = [json.dumps(record(i)) for i in range(5)] + ["{broken", "", json.dumps(record(9))]
    reader = LineReader(Buffer(text_chunks("\n".join(lines), chunk)))
    assert ids(list(reader)) == ["c0", "c1", "c2", "c3", "c4", "c9"] and reader.unreadable == 1


def test_memory_is_bounded_by_the_buffer_not_the_file(tmp_path):
    n = 40_000  # about 17 MB
    path = tmp_path / "big.json"
    path.write_text(json.dumps([record(i) for i in range(n)]))
    size = path.stat().st_size
    from data.sharegpt import open_source

    tracemalloc.start()
    try:
        with warnings.catch_warnings(), open_source(str(path)) as reader:
            warnings.simplefilter("error")
            seen = sum(1 for _ in reader)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == n and reader.unreadable == 0
    assert peak < size / 3, f"peak {peak / 1e6:.1f} MB reading a {size / 1e6:.1f} MB file"
