"""Streaming JSON records: a file opened with the right words for what it is, read in chunks, decoded record
by record in time linear in its size and memory bounded by the largest record, not the file.

Every error position the decoder computes costs a count of newlines from the start of the text it is given,
so the text is a sliding buffer that never keeps much before the current record: recovery after damage
(a resync trying each later `{`) stays linear however far into the file it happens.
"""
from __future__ import annotations

import codecs
import errno
import json
import re
import stat
import warnings
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from infra.cli import PolyspecError


class DataError(PolyspecError, RuntimeError):
    """A data source that cannot be read at all; the message is one line."""


CHUNK = 1 << 20  # characters read at a time
_KEEP = 1 << 16  # consumed text kept before the current position before it is dropped
_CUT_MARGIN = 16  # a decode error this close to the buffer's end may be a value the buffer cut, not the file
_TAIL = 256  # text kept when a resync drops a stretch without a record start (a key or `{` may continue there)

_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"(\xb5/\xfd": "zstd", b"PK\x03\x04": "zip"}
_BETWEEN_RECORDS = re.compile(r"[\s,]*")
_SPACE = re.compile(r"\s*")
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*+"|[\[\]{}]|"', re.DOTALL)  # a string, a bracket, or a string the text cuts
_CANDIDATE = re.compile(r'\{\s*"')  # where a record (an object with keys) may start
_RECORD_KEY = re.compile(r"""["']conversations?["']\s*:""")  # one per ShareGPT record, quoted either way
SURROGATE = re.compile("[\ud800-\udfff]")  # lone surrogates: undecodable bytes, or escapes like "\ud800"


def check_input_file(path: Path, what: str) -> Path:
    """`path` if it is a readable regular file; otherwise a DataError saying what it is instead (absent, a
    folder, a FIFO or device, a symlink loop, unreadable, compressed). Opens nothing that blocks: a FIFO
    is refused from its mode, before any read."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        if err.errno == errno.ENOENT:
            raise DataError(f"{path}: no such {what}") from None
        if err.errno == errno.ELOOP:
            raise DataError(f"{path}: a symlink loop, not a {what}") from None
        raise DataError(f"{path}: cannot read ({err.strerror or err.__class__.__name__})") from None
    if stat.S_ISDIR(mode):
        raise DataError(f"{path}: a folder, not a {what}")
    if not stat.S_ISREG(mode):
        raise DataError(f"{path}: not a regular file (a FIFO, socket or device), not a {what}")
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err.__class__.__name__})") from None
    for magic, kind in _COMPRESSED.items():
        if head.startswith(magic):
            raise DataError(f"{path}: {kind}-compressed; decompress it first (a {what} is plain UTF-8 JSON text)")
    return path


def file_chunks(handle: IO[bytes], origin: str, size: int = CHUNK) -> Iterator[str]:
    """The file's text in chunks: UTF-8 (a byte order mark dropped); undecodable bytes become lone surrogates,
    which mark only the records holding them as unreadable, not the whole file."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="surrogateescape")
    while True:
        try:
            data = handle.read(size)
        except OSError as err:
            raise DataError(f"{origin}: cannot read ({err.strerror or err.__class__.__name__})") from None
        text = decoder.decode(data, final=not data)
        if text:
            yield text
        if not data:
            return


def text_chunks(text: str, size: int = CHUNK) -> Iterator[str]:
    return (text[i:i + size] for i in range(0, len(text), size))


class Buffer:
    """The text of a stream, read on demand: `text` holds what is not yet dropped, `offset` counts the
    characters dropped before it. Positions into `text` stay valid until `drop`."""

    def __init__(self, chunks: Iterator[str]):
        self._chunks, self.text, self.offset, self.eof = chunks, "", 0, False

    def more(self, at_least: int = 1) -> bool:
        """Append at least `at_least` characters (whole chunks); False at the end of the stream."""
        parts, added = [], 0
        while added < max(at_least, 1) and not self.eof:
            chunk = next(self._chunks, None)
            if chunk is None:
                self.eof = True
            else:
                parts.append(chunk)
                added += len(chunk)
        if parts:
            self.text += "".join(parts)
        return added > 0

    def drop(self, pos: int) -> int:
        """Forget the text before `pos` once enough has been consumed; returns `pos` in the new text."""
        if pos < _KEEP:
            return pos
        self.text, self.offset = self.text[pos:], self.offset + pos
        return 0

    def skip(self, pos: int, pattern: re.Pattern) -> int:
        """The end of `pattern`'s match at `pos`, reading on while the match runs to the end of the text."""
        while True:
            end = pattern.match(self.text, pos).end()
            if end < len(self.text) or not self.more():
                return end


def decode_value(buf: Buffer, decoder: json.JSONDecoder, pos: int) -> tuple[str, Any, int]:
    """("ok", value, end), ("error", None, pos) for text that does not decode, or ("deep", None, pos) for a
    value nested beyond the recursion limit; reads on (doubling what it holds) while the buffer cut it."""
    while True:
        try:
            value, end = decoder.raw_decode(buf.text, pos)
        except RecursionError:
            return "deep", None, pos
        except json.JSONDecodeError as err:
            cut = err.msg.startswith("Unterminated string") or err.pos >= len(buf.text) - _CUT_MARGIN
            if cut and buf.more(len(buf.text) - pos):
                continue
            return "error", None, pos
        except ValueError:  # an integer beyond Python's digit limit
            return "error", None, pos
        if end == len(buf.text) and not isinstance(value, (dict, list)) and buf.more():
            continue  # a number or literal at the buffer's end may go on
        return "ok", value, end


def structure_end(buf: Buffer, start: int) -> int | None:
    """End of the bracketed value starting at `start` (strings skipped), or None if it never closes."""
    depth, pos = 0, start
    while True:
        for m in _TOKEN.finditer(buf.text, pos):
            token = m.group()
            if token == '"':  # a string the buffer cuts: rescan it with more text
                pos = m.start()
                break
            if token in "[{":
                depth += 1
            elif token in "]}":
                depth -= 1
                if depth <= 0:
                    return m.end()
        else:
            pos = len(buf.text)
        if not buf.more(len(buf.text) - start):
            return None


def count_keys(text: str, start: int, stop: int) -> int:
    """Record keys (`"conversations":`) beginning in text[start:stop]; a key may run past `stop`."""
    n = 0
    for m in _RECORD_KEY.finditer(text, start):
        if m.start() >= stop:
            break
        n += 1
    return n


def is_sharegpt_record(record: Any) -> bool:
    """Whether a decoded value can be a record of a ShareGPT array (not a turn or other nested object)."""
    return isinstance(record, dict) and ("conversations" in record or "conversation" in record)


class RecordReader:
    """Iterate the records of a JSON array (`array=True`) or of JSON values one after another (a .jsonl file
    pretty-printed), streaming. A record that does not decode is skipped: decoding resumes at the first later
    `{` whose object passes `is_record` and is followed by what follows a record at array level; the skipped
    records are counted in `unreadable` from their `"conversations"` keys (at least one). A cut-off array
    counts one. If several records after an unreadable one cannot be recovered, a warning says so."""

    def __init__(self, buf: Buffer, origin: str, array: bool = True,
                 is_record: Callable[[Any], bool] = is_sharegpt_record):
        self.buf, self.origin, self.array, self.is_record = buf, origin, array, is_record
        self.decoder, self.unreadable = json.JSONDecoder(), 0

    def __iter__(self) -> Iterator[Any]:
        pos = self._open()
        while pos is not None:
            pos = self.buf.skip(self.buf.drop(pos), _BETWEEN_RECORDS)
            text = self.buf.text
            if pos >= len(text):
                self.unreadable += self.array  # an array never closed: the file was cut off
                return
            if text[pos] == "]" and self.array:
                self._after_end(pos + 1)
                return
            status, value, end = (("error", None, pos) if text[pos] in "]}:"
                                  else decode_value(self.buf, self.decoder, pos))
            if status == "ok":
                yield value
                pos = end
            else:
                pos = self._resync(pos, status)

    def _open(self) -> int:
        pos = self.buf.skip(0, _BETWEEN_RECORDS)
        if self.buf.text.startswith("\ufeff", pos):  # a byte order mark after leading space
            pos = self.buf.skip(pos + 1, _BETWEEN_RECORDS)
        if not self.array:
            return pos
        if not self.buf.text.startswith("[", pos):
            undecodable = SURROGATE.search(self.buf.text, pos, pos + 4096) is not None
            raise DataError(f"{self.origin}: not {'UTF-8 text' if undecodable else 'a JSON array of ShareGPT records'}")
        return pos + 1

    def _after_end(self, pos: int) -> None:
        """After the closing bracket only space may follow; anything else is said, not counted as a record."""
        pos = self.buf.skip(pos, _SPACE)
        if pos < len(self.buf.text):
            warnings.warn(f"{self.origin}: text after the array's closing bracket "
                          f"(character {self.buf.offset + pos:,}) ignored", stacklevel=3)

    def _at_array_level(self, end: int) -> bool:
        """Whether what follows a value ending at `end` is what follows a record: another value, the array's
        closing bracket and nothing after it, or the end of the text."""
        pos = self.buf.skip(end, _BETWEEN_RECORDS)
        text = self.buf.text
        if pos >= len(text):
            return True
        if text[pos] == "]":
            return self.array and self.buf.skip(pos + 1, _SPACE) >= len(self.buf.text)
        return text[pos] not in "}:"

    def _resync(self, pos: int, status: str) -> int | None:
        """After an unreadable record at `pos`: the position of the next record from which decoding goes on,
        having counted the records skipped; None if nothing later can be recovered."""
        buf, start, keys, lost_at = self.buf, pos, 0, self.buf.offset + pos
        at = structure_end(buf, pos) if status == "deep" else pos + 1
        while at is not None:
            m = _CANDIDATE.search(buf.text, at)
            if m is None:  # no record start in the text so far: count its keys, forget it, read on
                cut = max(at, len(buf.text) - _TAIL)
                keys += count_keys(buf.text, start, cut)
                start = at = buf.drop(cut)
                if not buf.more():
                    break
                continue
            keys += count_keys(buf.text, start, m.start())
            start = at = buf.drop(m.start())
            status, value, end = decode_value(buf, self.decoder, at)
            if status == "ok" and self.is_record(value) and self._at_array_level(end):
                self.unreadable += max(1, keys)
                return at
            at = structure_end(buf, at) if status == "deep" else at + 1
        keys += count_keys(buf.text, start, len(buf.text))
        self.unreadable += max(1, keys)
        if keys > 1:
            dropped = buf.offset + len(buf.text) - lost_at
            warnings.warn(f"{self.origin}: unreadable JSON at character {lost_at:,}; "
                          "nothing after it could be recovered: "
                          f"about {keys:,} records ({dropped:,} characters) dropped", stacklevel=3)
        return None


class LineReader:
    """Iterate the records of JSON lines, streaming: lines split on \\n only (JSON text may hold U+2028,
    form feeds...); a line that does not decode is counted in `unreadable`."""

    def __init__(self, buf: Buffer):
        self.buf, self.unreadable = buf, 0

    def __iter__(self) -> Iterator[Any]:
        pos = 0
        while True:
            pos = self.buf.drop(pos)
            end = self.buf.text.find("\n", pos)
            while end < 0 and self.buf.more(len(self.buf.text) - pos):
                end = self.buf.text.find("\n", pos)
            line = self.buf.text[pos:end if end >= 0 else len(self.buf.text)]
            if line.strip():
                try:
                    yield json.loads(line)
                except (ValueError, RecursionError):  # syntax, an integer beyond the digit limit, deep nesting
                    self.unreadable += 1
            if end < 0:
                return
            pos = end + 1


def reader_for(buf: Buffer, origin: str, lines: bool) -> RecordReader | LineReader:
    """The reader for a file's text: JSON lines (`lines`, a .jsonl file) unless it holds a JSON array (first
    character `[`) or pretty-printed objects (first line a lone `{`), else a JSON array."""
    if not lines:
        return RecordReader(buf, origin)
    pos = buf.skip(0, _SPACE)
    if buf.text.startswith("\ufeff", pos):
        pos = buf.skip(pos + 1, _SPACE)
    if buf.text.startswith("[", pos):
        return RecordReader(buf, origin)
    first = buf.text.find("\n", pos)
    while first < 0 and buf.more():
        first = buf.text.find("\n", pos)
    if buf.text[pos:first if first >= 0 else len(buf.text)].strip() == "{":
        return RecordReader(buf, origin, array=False)
    return LineReader(buf)


def decode_records(text: str, origin: str,
                   is_record: Callable[[Any], bool] = is_sharegpt_record) -> tuple[list[Any], int]:
    """Every readable record of a JSON array held in `text` and the number of unreadable ones (see RecordReader)."""
    reader = RecordReader(Buffer(text_chunks(text)), origin, is_record=is_record)
    return list(reader), reader.unreadable
