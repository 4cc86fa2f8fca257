"""Spec-Bench-format prompt sets: JSON lines of {"question_id", "category", "turns": [...]}."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from data.sharegpt import DataError

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "default.jsonl"


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


def load_questions(path: str | Path | None = None, per_category: int | None = None) -> list[Question]:
    """Questions of a Spec-Bench `question.jsonl` (default: the project's six-category set).

    `per_category` keeps the first n questions of each category, for quick runs.
    """
    path = Path(path).expanduser() if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise DataError(f"{path}: no such question file")
    questions, seen = [], {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            turns = raw["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
            question = Question(raw["question_id"], str(raw.get("category", "uncategorized")), tuple(turns))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise DataError(f"{path}:{lineno}: not a Spec-Bench question ({err.__class__.__name__}: {err})") from None
        seen[question.category] = seen.get(question.category, 0) + 1
        if per_category is None or seen[question.category] <= per_category:
            questions.append(question)
    if not questions:
        raise DataError(f"{path}: no questions")
    return questions
