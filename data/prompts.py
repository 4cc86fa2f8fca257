"""Spec-Bench-format prompt sets: JSON lines of {"question_id", "category", "turns": [...]}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from data.records import SURROGATE, DataError, check_input_file

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "default.jsonl"


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


def _lines(path: Path) -> list[str]:
    """The file's lines, split on \\n only (JSON text may hold U+2028, U+2029, form feeds...); UTF-8, with
    or without a byte order mark; undecodable bytes are a one-line error naming the line."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror or err.__class__.__name__})") from None
    data = data.removeprefix(b"\xef\xbb\xbf")
    lines = []
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{lineno}: not UTF-8 text (byte {err.start + 1} of the line)") from None
    return lines


def parse_question(line: str) -> Question:
    """One Spec-Bench question from a JSON line; ValueError/TypeError/KeyError/RecursionError otherwise."""
    raw = json.loads(line)
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    turns, qid, category = raw["turns"], raw["question_id"], raw.get("category", "uncategorized")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("'turns' must be a non-empty list of non-empty strings")
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise ValueError(f"'question_id' must be a string or an integer, got {type(qid).__name__}")
    if not isinstance(category, str):
        raise ValueError(f"'category' must be a string, got {type(category).__name__}")
    if any(SURROGATE.search(s) for s in [*turns, category, str(qid)]):
        raise ValueError("text holds a lone surrogate (an escape such as \\ud800 that is not a character)")
    return Question(qid, category, tuple(turns))


def load_questions(path: str | Path | None = None, per_category: int | None = None) -> list[Question]:
    """Questions of a Spec-Bench `question.jsonl` (default: the project's six-category set).

    `per_category` keeps the first n questions of each category, for quick runs. A malformed line is a
    one-line DataError naming the file and line.
    """
    if per_category is not None and (isinstance(per_category, bool) or not isinstance(per_category, int)
                                     or per_category < 1):
        raise DataError(f"per_category must be null or an integer >= 1, got {per_category!r}")
    path = Path(path).expanduser() if path else DEFAULT_PROMPTS
    check_input_file(path, "question file")
    questions, seen, lines_of = [], {}, {}
    for lineno, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            question = parse_question(line)
        except RecursionError:
            raise DataError(f"{path}:{lineno}: not a Spec-Bench question (nested too deeply)") from None
        except (KeyError, TypeError, ValueError) as err:  # JSONDecodeError and the integer digit limit are ValueErrors
            message = (str(err).splitlines() or [""])[0]
            raise DataError(f"{path}:{lineno}: not a Spec-Bench question "
                            f"({err.__class__.__name__}: {message})") from None
        first = lines_of.setdefault(str(question.question_id), lineno)
        if first != lineno:  # results are keyed by question_id: a repeat would mix two questions' pairs
            raise DataError(f"{path}:{lineno}: question_id {question.question_id!r} repeats line {first}")
        seen[question.category] = seen.get(question.category, 0) + 1
        if per_category is None or seen[question.category] <= per_category:
            questions.append(question)
    if not questions:
        raise DataError(f"{path}: no questions")
    return questions
