"""Backends: how a level's model runs on its device, as a value. `Backend.prepare` returns a `Prepared` (the runner
factory and LM head a model level uses) and writes nothing onto the model: on the CPU its linears are swapped for
packed ones (the parameters stay; decode.backends.cpu), and a Llama-family model may run the native runner; on CUDA
every model runs a static KV cache with CUDA graphs (decode.backends.cuda); other devices run transformers' forward.
A GPTQ W4 level may run torch's own int4 kernels (decode.backends.int4pack): on CUDA by default, on a CPU when asked."""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decode.engine.runner import HeadRunner, HFHeadRunner, HFRunner, Prepared, PreparedHead, Runner

NATIVE = ("auto", "on", "off")
RUNNERS = ("auto", "static", "aoti", "eager")
W4_KERNELS = ("auto", "gptqmodel", "int4pack")


def on_cpu(module: nn.Module) -> bool:
    return next(module.parameters()).device.type == "cpu"


class BackendFieldError(ValueError):
    """A Backend value that is not one of its choices: `field` names it, `problem` says what is wrong with it."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class Backend:
    """How models run, resolved once from a run's settings. `gemm`: the packed product of CPU dense linears (None:
    unpacked). `native_fp32`: whether an fp32 Llama-family model runs the native CPU runner (auto, on, off);
    `native_w4` the same for a GPTQ W4 model, on `activations` (int8, fp32). Off the CPU all three are moot.
    `w4_kernel`: what runs a GPTQ W4 model's linears (see `int4pack`). `runner`: auto (CUDA: the compiled static
    runners, decode.backends.static; a CPU: the native runner where it runs the level, else the compiled runners
    compiled ahead of time), static (the compiled static runners on every device, as on CUDA, nothing native: a CPU
    runs the GPU's code path, its packed linears and attention on the project's kernels as torch operators), aoti
    (the same runners compiled ahead of time by AOTInductor, decode.backends.aoti: no Python between a call and its
    kernels) or eager (nothing compiled: on CUDA the hand-captured static runner, heads on their own forward; on a
    CPU the native runner or transformers' forward). The compiled runners' models and heads run their
    sibling linears (q/k/v, gate/up) as one product each (decode.backends.siblings)."""

    gemm: str | None = None
    native_fp32: str = "off"
    native_w4: str = "off"
    activations: str = "int8"
    w4_kernel: str = "auto"
    runner: str = "auto"

    def __post_init__(self) -> None:
        for key, choices in (("native_fp32", NATIVE), ("native_w4", NATIVE), ("w4_kernel", W4_KERNELS),
                             ("runner", RUNNERS)):
            if getattr(self, key) not in choices:
                raise BackendFieldError(key, f"must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        from decode.backends.cpu.llama import ACTIVATIONS

        if self.activations not in ACTIVATIONS:
            raise BackendFieldError("activations", f"must be one of {', '.join(ACTIVATIONS)}, "
                                                   f"got {self.activations!r}")

    def drafting(self, target: Prepared) -> "Backend":
        """The backend of a chain's other levels: fp32 ones run natively where they can, else compiled, when the
        target runs either; beside a target on transformers' forward, on theirs."""
        fast = runs_natively(target) or runs_static(target)
        return dataclasses.replace(self, native_fp32="auto" if fast else "off")

    def int4pack(self, device: torch.device | str) -> bool:
        """Whether a GPTQ W4 model on `device` runs torch's own int4 kernels (decode.backends.int4pack): where asked
        (`w4_kernel: int4pack`), and by default on CUDA, where GPTQModel's kernels need a build (nvcc); `auto` keeps
        GPTQModel's CPU kernel and the native runner on a CPU."""
        return self.w4_kernel == "int4pack" or (self.w4_kernel == "auto" and torch.device(device).type == "cuda")

    def load(self, spec: str, dtype: str,
             device: torch.device | str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        """A level's model and tokenizer from a model spec (data.models.load_model); a GPTQ folder on torch's int4
        kernels where `int4pack` says. ValueError (one line) for a checkpoint those kernels cannot take."""
        from data.models import load_model, load_tokenizer, resolve_model_path
        from decode.backends.int4pack import is_gptq_folder, load_int4pack

        path = resolve_model_path(spec)
        if self.int4pack(device) and is_gptq_folder(Path(path)):
            return load_int4pack(path, dtype, device), load_tokenizer(spec)
        return load_model(spec, dtype, device)

    def prepare(self, model: PreTrainedModel) -> Prepared:
        """`model` made fast on its device (CPU: linears packed in place; the packed copies are an inference-time
        cache) and how it runs. ValueError where `native_*=on` cannot run it."""
        compiled = self.compiles(model)
        if self.gemm and on_cpu(model) and compiled:  # W4: the project's int4 tiles, compiled
            from decode.backends.cpu.kernel_linear import int4_on_kernels

            int4_on_kernels(model, self.activations)
        if self.gemm and on_cpu(model):
            from decode.backends.cpu import pack

            pack(model, self.gemm)
        if compiled:  # q/k/v and gate/up: one kernel each
            from decode.backends.siblings import stack_siblings

            ids = torch.arange(2, 6, device=model.device)[None] % model.get_input_embeddings().num_embeddings
            stack_siblings(model, lambda: model(input_ids=ids, use_cache=False))
        new_runner = self._runner_factory(model, compiled)
        return Prepared(model, new_runner, _fast_lm_head(model.get_output_embeddings(), new_runner))

    def prepare_head(self, head: nn.Module, weights: str | None = None) -> PreparedHead:
        """A draft head as it runs here: packed in place on the CPU, its draft-vocabulary LM head rows on the packed
        product (None: the head computes its logits as it is), and the native runner for an EAGLE-2 head where fp32
        models may run natively (`native_fp32` auto or on) and it can, else under auto the compiled head runner,
        else its own forward (said on stderr).
        `weights: int8`: on the native runner, fc, the layer and the LM head rows on int8 rows (elsewhere the head
        keeps its own weights, said on stderr)."""
        compiled = self.compiles(head, is_head=True)
        if self.gemm and on_cpu(head):
            from decode.backends.cpu import pack

            pack(head, self.gemm)
        if compiled and on_cpu(head):  # attention as a packed model's: the kernel reads the keys written, not the span
            from decode.backends.cpu.attention import use_packed_attention
            from decode.backends.cpu.dense import packed_with

            use_packed_attention(head.config, packed_with(head))
        if compiled:
            from decode.backends.siblings import stack_siblings

            weight = head.fc.weight
            ids, features = torch.arange(2, 6, device=weight.device)[None], weight.new_zeros(1, 4, head.feature_size)
            stack_siblings(head, lambda: head(ids, features))
        vocab = getattr(head, "draft_vocab", None)
        rows = None if vocab is None or not hasattr(head, "draft_rows") else self.linear(head, head.draft_rows())
        int8 = weights == "int8" and on_cpu(head) and _int8_problem(head) is None
        new_runner = self._head_runner_factory(head, int8, compiled)
        if int8 and _native_head(new_runner):
            from decode.backends.cpu.eagle_head import int8_linear

            rows = int8_linear(head.draft_rows() if vocab is not None else head.lm_head)
        elif weights == "int8":
            param = next(head.parameters())
            print(int8_fallback("weights: int8", "the draft head", param.device, param.dtype) or
                  "decode: weights: int8 runs on the native head runner only (inputs in blocks of 16); the draft head "
                  "keeps its own weights", file=sys.stderr)
        return PreparedHead(head, new_runner, rows)

    def linear(self, module: nn.Module, linear: nn.Linear) -> nn.Module:
        """A linear built later for `module` (a vocabulary's LM-head rows), on the packed product where one runs."""
        if not self.gemm or not on_cpu(module):
            return linear
        from decode.backends.cpu.dense import packed_or_plain

        return packed_or_plain(linear, self.gemm)

    def compiled(self, cuda: bool) -> bool:
        """Whether a level on CUDA (`cuda`) or a CPU runs the compiled static runners whatever the model: where asked,
        and on CUDA unless eager (`compiles` adds a CPU's models that the native runner will not run)."""
        return self.runner in ("static", "aoti") or (cuda and self.runner == "auto")

    def compiles(self, module: nn.Module, is_head: bool = False) -> bool:
        """Whether `module` (a level's model, or a draft head) runs the compiled static runners: where `compiled`
        says, and under auto on a CPU where its linears are packed, the project's kernels build and the native
        runner will not run it (said on stderr, why)."""
        if self.compiled(next(module.parameters()).device.type == "cuda"):
            return True
        if self.runner != "auto" or not (self.gemm and on_cpu(module)):
            return False
        from decode.backends.cpu.kernels import kernel_ops
        from decode.backends.cuda.runner import quantized_experts
        from decode.backends.int4pack import is_int4pack

        declined = is_int4pack(module) or quantized_experts(module) or kernel_ops()[0] is None
        why = None if declined else self._native_problem(module, is_head)
        if why is not None:
            what = "the draft head" if is_head else module.name_or_path
            print(f"decode: {what} runs the compiled runner, ahead of time (native runner: {why})", file=sys.stderr)
        return why is not None

    def compiler(self, cuda: bool) -> str:
        """What compiles the compiled runners' forwards: AOTInductor (decode.backends.aoti; asked, or auto on a CPU)
        or torch.compile's inductor."""
        return "aoti" if self.runner == "aoti" or (self.runner == "auto" and not cuda) else "inductor"

    def _native_problem(self, module: nn.Module, is_head: bool) -> str | None:
        """Why the native runner, where its setting leaves the choice to the backend (`auto`), will not run `module`;
        None where it will, or where the setting decides (`on`: native; `off`: transformers' forward)."""
        from decode.backends.cpu.eagle_head import head_unsupported
        from decode.backends.cpu.llama import is_quantized, unsupported

        setting = "native_w4" if not is_head and is_quantized(module) else "native_fp32"
        if getattr(self, setting) != "auto":
            return None
        return head_unsupported(module) if is_head else unsupported(module)

    def _runner_factory(self, model: PreTrainedModel, compiled: bool) -> Callable[[], Runner]:
        hf = functools.partial(HFRunner, model)
        cuda = next(model.parameters()).device.type == "cuda"
        if compiled:  # graphs on CUDA
            from decode.backends.static import static_runners

            return static_runners(model, backend=self.compiler(cuda))
        if cuda:  # a static KV cache and CUDA graphs of the eager forward
            from decode.backends.cuda import cuda_runners

            return cuda_runners(model)
        if not on_cpu(model):
            return hf
        from decode.backends.int4pack import is_int4pack

        if is_int4pack(model):  # torch's int4 kernel under transformers' forward (the native runner reads GPTQModel's)
            return hf
        from decode.backends.cpu.llama import NativeLlamaRunner, is_quantized, native_fp32_runner, unsupported

        if not is_quantized(model):  # the native fp32 forward reads the packed panels
            return (self.gemm and native_fp32_runner(model, self.native_fp32)) or hf
        if self.native_w4 == "off":
            return hf
        why = unsupported(model)
        if why is None:
            return functools.partial(NativeLlamaRunner, model, activations=self.activations)
        if self.native_w4 == "on":
            raise ValueError(f"native=on: the native runner cannot run {model.name_or_path}: {why}")
        print(f"decode: {model.name_or_path} runs the eager HF forward (native runner: {why})", file=sys.stderr)
        return hf

    def _head_runner_factory(self, head: nn.Module, int8: bool, compiled: bool) -> Callable[[], HeadRunner]:
        if compiled:
            from decode.backends.static import CompiledHeadRunner

            cuda = next(head.parameters()).device.type == "cuda"
            return functools.partial(CompiledHeadRunner, head, backend=self.compiler(cuda))
        if not (self.gemm and on_cpu(head)) or self.native_fp32 == "off":
            return functools.partial(HFHeadRunner, head)
        from decode.backends.cpu.eagle_head import head_unsupported, native_head_runners

        why = head_unsupported(head)
        if why is None:
            return native_head_runners(head, int8)
        print(f"decode: the draft head runs its own forward (native runner: {why})", file=sys.stderr)
        return functools.partial(HFHeadRunner, head)


def int8_fallback(setting: str, what: str, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """The line said where `what`'s int8 weights (`setting`: a drafting level's `lm_head: int8`, an EAGLE level's
    `weights: int8`) cannot run, None where they can: their products are CPU kernels, so on another device (CUDA) the
    level keeps its weights in its own dtype (bf16 on a GPU chain). Proposals only either way: the output is the
    target's."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    return (f"decode: {what}: {setting} is a CPU kernel; on {device.type} it keeps its "
            f"{str(dtype).removeprefix('torch.')} weights")


def with_lm_head(prepared: Prepared, head: nn.Module) -> Prepared:
    """`prepared` with another LM head (e.g. an int8 one), as its runner's backend runs it."""
    return dataclasses.replace(prepared, lm_head=_fast_lm_head(head, prepared.new_runner))


def runs_natively(prepared: Prepared) -> bool:
    """Whether a prepared model runs the native CPU runner."""
    return _native(prepared.new_runner)


def runs_static(prepared: Prepared) -> bool:
    """Whether a prepared model runs the static runner (compiled or not)."""
    return _static(prepared.new_runner)


def _static(new_runner: Callable[[], Runner]) -> bool:
    from decode.backends.cuda.runner import StaticRunner

    func = getattr(new_runner, "func", None)
    return isinstance(func, type) and issubclass(func, StaticRunner)


def _int8_problem(head: nn.Module) -> str | None:
    from decode.backends.cpu.eagle_head import int8_problem

    return int8_problem(head)


def _native_head(new_runner: Callable[[], HeadRunner]) -> bool:
    from decode.backends.cpu.eagle_head import NativeHeadRunner

    return getattr(new_runner, "func", None) is NativeHeadRunner


def _native(new_runner: Callable[[], Runner]) -> bool:
    from decode.backends.cpu.llama import NativeLlamaRunner

    return getattr(new_runner, "func", None) is NativeLlamaRunner


def _fast_lm_head(head: nn.Module, new_runner: Callable[[], Runner]) -> nn.Module:
    """The native int8 kernel for an int8 LM head (`lm_head: int8`) beside the native runner or a CPU's compiled one
    (the LM head runs after the runner, on its output), else `head` (aten's int8 product on bf16 activations)."""
    from decode.backends.cpu.int8 import Int8RowLinear

    if not isinstance(head, Int8RowLinear) or not (_native(new_runner) or _static(new_runner)):
        return head
    from decode.backends.cpu.llama import NativeInt8Linear, native_kernels

    return NativeInt8Linear(head) if native_kernels()[0] is not None else head
