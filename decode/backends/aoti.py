"""A static runner's forward compiled ahead of time by AOTInductor (`backend="aoti"`, CPU): each shape of its inputs
exported once (torch.export) and compiled into a shared library whose C++ runs every kernel of the forward. A call
hands the library its inputs and nothing else: no dynamo frame, no guards and no Python fetching each of the module's
tensors (torch.compile's entry does that at every call, for every weight). The library reads the module's own tensors
(handed over user-managed: never copied) and writes the KV cache's buffers, which are its inputs, in place; so a
keep or a rollback between calls stays the runner's own Python.

The compiled libraries are cached on disk under the project's cache dir, keyed by the exported program (its graph with
every tensor's shape, dtype and strides, and its signature), the compile's options, torch's version and the vector ISA
the C++ was compiled for: not by the weights, which the library is handed when loaded. A later process, or another
model of the same shapes, exports (seconds) and loads; only a new shape compiles."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch.utils import _pytree

from data.models import cache_dir

CACHE_TENSORS = ("slots", "key_length")  # a StaticKV's per-call tensors, inputs of the exported forward
# Every library reads the module's tensors handed over at load: none packaged, none frozen or folded into its code.
# freezing and max_autotune are process-wide inductor config that other libraries set (GPTQModel's int4 linear does)
LIBRARY_CONFIG = {"aot_inductor.package_constants_in_so": False, "freezing": False, "max_autotune": False}


class Exported(torch.nn.Module):
    """`forward(module, cache, *args)` as a module whose inputs are tensors only: the cache's per-call tensors, the
    tensor arguments and the KV buffers (keys, values of each layer, in order); `args`' other values are fixed."""

    def __init__(self, forward: Callable, module: torch.nn.Module, cache, args: tuple):
        super().__init__()
        self.run, self.module, self.cache = forward, module, cache
        self.fixed = [None if isinstance(a, torch.Tensor) else a for a in args]

    def forward(self, *inputs: torch.Tensor) -> object:
        present = cache_inputs(self.cache)
        for name, tensor in zip(present, inputs):
            setattr(self.cache, name, tensor)
        tensors = iter(inputs[len(present):])
        args = [next(tensors) if a is None else a for a in self.fixed]
        kv = list(tensors)
        self.cache.buffers = list(zip(kv[0::2], kv[1::2]))
        return self.run(self.module, self.cache, *args)


def cache_inputs(cache) -> list[str]:
    """The names of the cache's per-call tensors this call has (a forward that reads no prefix has no key length)."""
    return [name for name in CACHE_TENSORS if getattr(cache, name) is not None]


def call_inputs(cache, args: tuple) -> list[torch.Tensor]:
    """An exported forward's inputs, in Exported's order."""
    return [*(getattr(cache, name) for name in cache_inputs(cache)), *(a for a in args if isinstance(a, torch.Tensor)),
            *(t for pair in cache.buffers for t in pair)]


def shape_key(inputs: list[torch.Tensor], args: tuple) -> tuple:
    """What selects a compiled library: every input's shape and dtype, and the fixed arguments."""
    return tuple((t.shape, t.dtype) for t in inputs), tuple(None if isinstance(a, torch.Tensor) else a for a in args)


def library_constants(program: torch.export.ExportedProgram, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a compiled library reads, under the names it gives them: parameters and buffers by their names
    (the module's, under Exported's `module.`), lifted tensor attributes (packed weights) as `_tensor_constant<i>`
    in the program's order of them."""
    named = {f"module.{name}": t for name, t in (*module.named_parameters(), *module.named_buffers())}
    lifted = [spec.target for spec in program.graph_signature.input_specs
              if spec.kind == torch.export.graph_signature.InputKind.CONSTANT_TENSOR]
    return named | {f"_tensor_constant{i}": program.constants[name] for i, name in enumerate(lifted)}


class Library:
    """A compiled forward, loaded: called with its flat inputs (the loaded package's own call parses its input and
    output specs and flattens the inputs again at every call). It holds the tensors it reads: they are handed to it
    user-managed, not copied."""

    def __init__(self, package: str, constants: dict[str, torch.Tensor]):
        self.loader = torch._inductor.aoti_load_package(package).loader
        self.constants = {name: constants[name] for name in self.loader.get_constant_fqns()}
        self.loader.load_constants(self.constants, False, True, True)  # not inactive; check all are given; user-managed
        self.outputs = _pytree.treespec_loads(self.loader.get_call_spec()[1])

    def __call__(self, inputs: list[torch.Tensor]) -> object:
        return _pytree.tree_unflatten(self.loader.boxed_run(inputs), self.outputs)


def program_key(program: torch.export.ExportedProgram, options: dict[str, object]) -> str:
    """What a compiled library depends on, hashed: the program's graph with each tensor's shape, dtype, strides and
    device, its signature (which input is which parameter, buffer or constant), the options, torch's version and the
    vector ISA inductor compiles the C++ for (a cache dir shared between CPU kinds, or ATEN_CPU_CAPABILITY=avx2,
    gets a library of its own)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    graph = program.graph_module.print_readable(print_output=False, include_stride=True, include_device=True)
    settings = sorted((str(key), repr(value)) for key, value in options.items())
    text = "\n".join([graph, str(program.graph_signature), repr(settings), torch.__version__, str(pick_vec_isa())])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def compiled_package(program: torch.export.ExportedProgram, options: dict[str, object]) -> Path:
    """The program's compiled package, from the disk cache or compiled into it (in a temporary file renamed into
    place: a killed compile or a second process compiling the same key leaves no partial package)."""
    options = {**options, **LIBRARY_CONFIG}
    path = cache_dir() / "aoti" / f"{program_key(program, options)}.pt2"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        package = torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(folder) / path.name), inductor_configs=options)
        os.replace(package, path)
    return path


def compile_library(forward: Callable, module: torch.nn.Module, cache, args: tuple,
                    options: dict[str, object]) -> Library:
    """`forward(module, cache, *args)` exported for these inputs' shapes, compiled by AOTInductor (or found compiled
    on disk), loaded with the module's tensors."""
    held = {name: getattr(cache, name) for name in ("buffers", *CACHE_TENSORS)}  # tracing sets them to its own
    try:
        with torch.inference_mode(False), torch.no_grad():
            example = tuple(t.clone() if t.is_inference() else t for t in call_inputs(cache, args))
            program = torch.export.export(Exported(forward, module, cache, args), example, strict=False)
    finally:
        for name, value in held.items():
            setattr(cache, name, value)
    return Library(str(compiled_package(program, options)), library_constants(program, module))


class AheadOfTime:
    """A forward compiled by AOTInductor per shape of its inputs: called as torch.compile's result is,
    `compiled(module, cache, *args)`; the first call of a shape compiles it (a runner's warm-up)."""

    def __init__(self, forward: Callable, options: dict[str, object]):
        self.forward, self.options = forward, options
        self.libraries: dict[tuple, Library] = {}

    def __call__(self, module: torch.nn.Module, cache, *args) -> object:
        inputs = call_inputs(cache, args)
        key = shape_key(inputs, args)
        if key not in self.libraries:
            self.libraries[key] = compile_library(self.forward, module, cache, args, self.options)
        return self.libraries[key](inputs)
