"""The house's shape rules, checked on the source: no function in decode/ or train/ over 60 lines or 6 parameters
unless a comment on its signature says why (e.g. a signature transformers fixes)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def oversized() -> list[str]:
    found = []
    for path in sorted(p for package in ("decode", "train") for p in (ROOT / package).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").split("\n")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            params = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            length = node.end_lineno - node.lineno + 1
            signature = "\n".join(lines[node.lineno - 1: node.body[0].lineno - 1])
            if (length > 60 or len(params) > 6) and "#" not in signature:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines, "
                             f"{len(params)} parameters")
    return found


def test_functions_are_small_or_say_why():
    assert oversized() == []
