"""The house's shape rules, checked on the source: no function in the packages over 60 lines or 6 parameters (no
exemptions), ruff's check clean under pyproject.toml's rules (lines <= 120 characters among them), no test that
times the machine, and no history (issue numbers, dates, measured timings) in comments and docstrings."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
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


# Speed lives in benchmarks (decode.bench, decode.costs, BENCHMARKS.md), never in a test: a test that reads a clock
# or asserts a measured rate against a bound fails on a busy machine with no bug in the code. Under the
# `virtual_clock` fixture (tests/clock_fixtures.py) the durations are the test's own, and asserting on them is fine.
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
          "process_time_ns", "thread_time", "thread_time_ns", "synchronized_clock", "default_timer"}
MEASURED = {"tokens_per_s", "median_tokens_per_s", "bytes_per_s", "speedup", "speedup_over_ar", "time_speedup", "x_ar",
            "wall_time_s", "time_to_first_token_s", "decode_time_s", "verify_time_s", "draft_time_s", "seconds",
            "elapsed", "ms", "round_ms", "overhead_ms", "forward_ms", "T_new", "T_old", "bandwidth"}
ORDERINGS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _reads_clock(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name in CLOCKS and not (isinstance(func, ast.Name) and name == "time")  # time(): only `from time import`


def _measured(node: ast.AST, tainted: set[str]) -> bool:
    """Whether `node` holds a measured time or rate: a clock read, a measurement's name, or a variable made of one
    (not a function named after one: `time_speedup(...)` of timings the test wrote is no measurement)."""
    called = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    for sub in ast.walk(node):
        if (_reads_clock(sub) or (isinstance(sub, ast.Name) and sub.id in tainted | MEASURED and id(sub) not in called)
                or (isinstance(sub, ast.Attribute) and sub.attr in MEASURED)
                or (isinstance(sub, ast.Constant) and sub.value in MEASURED)):
            return True
    return False


def _tainted(func: ast.AST) -> set[str]:
    """Names a test assigns (or appends) a measurement to, to a fixpoint."""
    tainted: set[str] = set()
    while True:
        before = set(tainted)
        for node in ast.walk(func):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if _measured(node.value, tainted):
                    tainted |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("append", "extend") and isinstance(node.func.value, ast.Name)
                  and any(_measured(a, tainted) for a in node.args)):
                tainted.add(node.func.value.id)
        if tainted == before:
            return tainted


def _bound(node: ast.AST, tainted: set[str]) -> bool:
    """A side a measurement is held against: anything not itself measured but zero (a rate above 0 is a sanity
    check, and two readings of one clock keep their order however busy the machine)."""
    return not _measured(node, tainted) and not (isinstance(node, ast.Constant) and node.value == 0)


def _is_set(node: ast.AST) -> bool:
    """A set literal or set(...): `<=` is inclusion there (the names of timed rows), not an ordering of numbers."""
    return isinstance(node, ast.Set) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                                         and node.func.id in ("set", "frozenset"))


def _holds_against_a_bound(node: ast.AST, tainted: set[str]) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    return any(isinstance(op, ORDERINGS) and not _is_set(a) and not _is_set(b)
               and (_measured(a, tainted) and _bound(b, tainted) or _measured(b, tainted) and _bound(a, tainted))
               for op, a, b in zip(node.ops, sides, sides[1:]))


def timed_assertions(source: str, where: str = "") -> list[str]:
    """Each test (or helper) in `source` that reads a clock, or asserts a measurement against a bound, outside the
    `virtual_clock` fixture."""
    tree = ast.parse(source)
    module_clock = 'usefixtures("virtual_clock")' in source
    found = []
    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        if module_clock or "virtual_clock" in [a.arg for a in func.args.args]:
            continue
        tainted = _tainted(func)
        for node in ast.walk(func):
            if _reads_clock(node):
                found.append(f"{where}:{node.lineno} {func.name}: reads the clock")
            elif isinstance(node, ast.Assert) and any(_holds_against_a_bound(c, tainted) for c in ast.walk(node.test)):
                found.append(f"{where}:{node.lineno} {func.name}: asserts a measurement against a bound")
    return found


def test_no_test_times_the_machine():
    found = [hit for path in sorted((ROOT / "tests").rglob("*.py"))
             for hit in timed_assertions(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert found == []


PLANTED_TIMED = '''
def test_stream(kernel):
    ratios = []
    for _ in range(2):
        stream = read_bandwidth(gib=0.25, repeats=3, stream=stream_kernel())
        ratios.append(stream.bytes_per_s / read_bandwidth(gib=0.25).bytes_per_s)
    assert 0.8 < max(ratios) and min(ratios) < 3, ratios

def test_forward_is_quick(model):
    start = time.perf_counter()
    model(x)
    assert time.perf_counter() - start < 0.5

def test_decodes_fast(chain):
    stats = chain.generate([1, 2], 8).stats
    assert stats.tokens_per_s > 50

def test_chain_beats_ar(report):
    assert report["chains"]["dualistic"]["time_speedup"] > 1.0
'''
PLANTED_FINE = '''
pytestmark = pytest.mark.usefixtures("other")

def test_timings_the_test_wrote(virtual_clock):
    start = time.perf_counter()
    assert report["chains"]["dualistic"]["time_speedup"] > 1.0 and time.perf_counter() - start > 0

def test_sanity(stats):
    assert 0 < stats.time_to_first_token_s <= stats.wall_time_s and stats.tokens_per_s > 0

def test_theory():
    assert predicted_speedup([10, 1], [1], 3, target_time=10) < 1 and {"target"} <= set(costs["ms"])
'''


def test_the_timing_rule_catches_a_planted_timed_assertion_and_passes_what_load_cannot_change():
    assert sorted(hit.split(" ", 1)[1] for hit in timed_assertions(PLANTED_TIMED)) == [
        "test_chain_beats_ar: asserts a measurement against a bound",
        "test_decodes_fast: asserts a measurement against a bound",
        "test_forward_is_quick: asserts a measurement against a bound", "test_forward_is_quick: reads the clock",
        "test_forward_is_quick: reads the clock", "test_stream: asserts a measurement against a bound"]
    assert timed_assertions(PLANTED_FINE) == []


# History lives in git and BENCHMARKS.md; comments, docstrings and config comments explain the code as it is. A
# reference to an issue, a date or a measured time or rate there goes stale the day it is written.
HISTORY = {
    "an issue number": re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d{2,}\b", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* "
                         r"(?:\d{1,2}, )?20\d\d\b"),
    "a measured time or rate": re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|ns|s|seconds?|min|minutes?|hours?)\b"
                                          r"|\b\d+\.\d+x\b|\b\d[\d,.]*\s?(?:tok/s|tokens/s|GB/s|MB/s)"),
}
SOURCES = (*PACKAGES, "scripts", "benchmarks")


def explanations(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file, or every comment of a YAML config."""
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".yaml":
        return [(i, line[line.index("#"):]) for i, line in enumerate(source.split("\n"), 1) if "#" in line]
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found.append((node.body[0].lineno, doc))
    return found


def history_in_comments(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} names {what}: {match.group(0)!r}"
            for path in paths for line, text in explanations(path)
            for what, pattern in HISTORY.items() for match in pattern.finditer(text)]


def test_comments_and_docstrings_explain_the_code_not_its_history():
    paths = sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py")) + sorted(
        (ROOT / "conf").rglob("*.yaml"))
    assert history_in_comments(paths) == []


def test_the_history_check_finds_each_kind(tmp_path):
    """Planted: one comment or docstring of each kind the check exists for."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""Faster since issue 41."""\n\n\ndef f():\n    """Measured 2026-11-26."""\n'
                       "    return 1  # was 2.5 s a token, now 14.6 ms; 1.27x\n")
    found = sorted(f.split(" names ")[1] for f in history_in_comments([planted]))
    assert found == ["a date: '2026-11-26'", "a measured time or rate: '1.27x'", "a measured time or rate: '14.6 ms'",
                     "a measured time or rate: '2.5 s'", "an issue number: 'issue 41'"]


# A leading underscore says "only this module uses it": another module importing it makes a private name public
# without saying so.
def private_imports(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in SOURCES:
                found += [f"{path.name}:{node.lineno} imports {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from decode.backends.cpu.dense import PackedLinear, _hidden\nfrom os import _exit\n")
    assert private_imports([planted]) == ["planted.py:1 imports decode.backends.cpu.dense._hidden"]
    assert private_imports(sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))) == []
