"""The packages' imports flow one way: infra <- data <- heads <- quantize, train <- decode apps; inside decode,
engine <- backends <- apps; train reaches nothing of decode; benchmarks/ may import anything, and nothing of the
product imports it. Read from the source (every import, lazy ones inside functions too), so nothing has to be imported
to check."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("infra", "data", "heads", "train", "quantize", "decode")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """Project modules `path` imports (a `from package import module` counts as the module where one exists)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name.split(".")[0] in PACKAGES:
                if name in MODULES:
                    found.add(name)
                    break
                name = name.rpartition(".")[0]
    return found


MODULES = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
GRAPH = {name: project_imports(path) - {name} for name, path in MODULES.items()}


def in_engine(name: str) -> bool:
    """decode.engine and its modules (not decode.engines, the real engines the apps run beside polyspec's)."""
    return name == "decode.engine" or name.startswith("decode.engine.")


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_engine_imports_no_backend_app_or_cli():
    def allowed(dep):
        return in_engine(dep) or dep.startswith(("heads", "data")) or dep.startswith("infra") and dep != "infra.cli"

    bad = {name: sorted(d for d in deps if not allowed(d))
           for name, deps in GRAPH.items() if in_engine(name)}
    assert not {n: d for n, d in bad.items() if d}, bad
    for name in (n for n in MODULES if in_engine(n)):
        assert "hydra" not in MODULES[name].read_text(), f"{name} imports a CLI framework"


def test_layers_import_downward_only():
    def rank(m):
        return (0 if m.startswith("infra") else 1 if m.startswith("data") else 2 if m.startswith("heads")
                else 3 if m.startswith(("quantize", "train")) or in_engine(m)
                else 4 if m.startswith("decode.backends") else 5)

    upward = {f"{n} -> {d}" for n, deps in GRAPH.items() for d in deps if rank(d) > rank(n)}
    assert not upward, sorted(upward)


def test_train_reaches_nothing_of_decode():
    """The heads train/ trains live in heads/, apart from the engine: no train module imports decode, directly or
    through another module."""
    route = {n: n for n in GRAPH if n.split(".")[0] == "train"}  # module -> how train reaches it
    todo = sorted(route)
    while todo:
        name = todo.pop()
        for dep in sorted(GRAPH[name] - route.keys()):
            route[dep] = f"{route[name]} -> {dep}"
            todo.append(dep)
    reached = sorted(r for m, r in route.items() if m.split(".")[0] == "decode")
    assert not reached, reached


def imported_roots(path: Path) -> set[str]:
    """The top-level names of every absolute import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return ({alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
            | {n.module.split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.module and n.level == 0})


def test_the_product_stands_apart_from_its_benchmarks():
    """benchmarks/ measures the product from outside: no product module imports it, and the wheel leaves it out."""
    importing = sorted(name for name, path in MODULES.items() if "benchmarks" in imported_roots(path))
    assert not importing, importing
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any("benchmarks".startswith(pattern.rstrip("*")) for pattern in found["include"]), found


APPS = {name for name, path in MODULES.items() if 'if __name__ == "__main__"' in path.read_text()}


def test_no_app_imports_another_app():
    assert {"decode.eval", "decode.bench", "train.eagle", "quantize.w4"} <= APPS
    crossing = {f"{n} -> {d}" for n in APPS for d in GRAPH[n] if d in APPS}
    assert not crossing, sorted(crossing)


def test_the_decode_root_holds_only_apps_and_their_door():
    root = {name for name, path in MODULES.items() if path.parent == ROOT / "decode" and path.stem != "__init__"}
    assert root and root <= APPS | {"decode.settings"}, sorted(root - APPS)


def test_where_the_code_lives_names_every_package():
    """docs/design.md's map of the house names each package and each of decode's folders (`heads`, `publish/`)."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    house = design[design.index("**Where the code lives.**"):].split("\n\n")[0]
    packages = [name for name, path in MODULES.items() if path.name == "__init__.py" and name.count(".") <= 1]
    named = {word.rstrip("/") for word in re.findall(r"`([^`]+)`", house)}
    unnamed = [n for n in packages if n.rpartition(".")[2] not in named]
    assert packages and not unnamed, unnamed


def config_parameters(path: Path) -> list[str]:
    """Functions of `path` that take a Hydra config: a parameter named cfg or *_cfg (qcfg, chain_cfg), or one
    annotated DictConfig."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(a.arg == "cfg" or a.arg.endswith("cfg") or a.arg.endswith("_cfgs")
                   or "DictConfig" in ast.unparse(a.annotation or ast.Constant(None)) for a in args):
                found.append(f"{node.name}:{node.lineno}")
    return found


def is_door(name: str) -> bool:
    """A package's settings module: where a stage's config is read into frozen values."""
    return name.endswith(".settings")


def test_only_the_apps_see_a_hydra_config():
    """Below the apps nothing takes a config or imports omegaconf/hydra: each app's `main` hands its config to a
    settings module once, and everything else takes the frozen values that come back."""
    seen = {}
    for name, path in MODULES.items():
        if is_door(name):
            continue
        taking = config_parameters(path)
        if name in APPS:
            taking = [f for f in taking if not f.startswith("main:")]
        imports = {a.name.split(".")[0] for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import)
                   for a in n.names} | {n.module.split(".")[0] for n in ast.walk(ast.parse(path.read_text()))
                                        if isinstance(n, ast.ImportFrom) and n.module}
        if name not in APPS and imports & {"omegaconf", "hydra"}:
            taking.append("imports " + "/".join(sorted(imports & {"omegaconf", "hydra"})))
        if taking:
            seen[name] = taking
    assert not seen, seen
