"""The house's shape rules, checked on the source: no function in the packages over 60 lines or 6 parameters (no
exemptions), and ruff's check clean under pyproject.toml's rules (lines <= 120 characters among them)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infra", "data", "heads", "train", "quantize", "decode")


def oversized() -> list[str]:
    found = []
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").split("\n")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            params = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            length = node.end_lineno - node.lineno + 1
            if length > 60 or len(params) > 6:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines, "
                             f"{len(params)} parameters")
    return found


def test_functions_are_small():
    assert oversized() == []


def test_ruff_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
