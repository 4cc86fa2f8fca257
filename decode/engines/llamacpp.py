"""llama.cpp, run for real: built once from the llama.cpp that the `llama-cpp-python` sdist vendors, run as its own
command-line tools (plain greedy decoding, speculative decoding with a draft GGUF, n-gram modes) whose reports are
parsed here, and fed the chain's models as GGUF files (the fp32 target, and the W4 level written exactly as Q4_0).

The build lives under the cache dir, one folder per sdist version, CPU kind and ISA options: on x86 the instruction
sets are named from /proc/cpuinfo's flags (GGML_NATIVE=OFF), since `-march=native` turns on ggml's AMX matmul on
an AMX host regardless of the GGML_AMX_* options, and that path dies with SIGILL (`tilezero` on an OpenMP worker,
Sapphire Rapids; ggml does ask Linux for the tile-data permission, so the cause is not found); AMX is left out
everywhere until it works. An AVX-512 build must not run on an AVX2-only machine; with the AVX2 paths forced
(ATEN_CPU_CAPABILITY=avx2) an AVX-512 host builds and runs an AVX2-only llama.cpp of its own. It is all-or-nothing
like the vLLM venv (decode/engines/vllm_venv.py): everything is built in a work folder, the tools are copied into a
staging folder whose marker file is written last, and the staging folder is renamed into place; a folder without
the marker (a killed build) is rebuilt from scratch. The tools are linked statically, so they run without
LD_LIBRARY_PATH.

The target GGUF is the bundled Q4_1 GGUF expanded to F32: the very weights polyspec's fp32 target holds. The W4
level is the target GGUF with its linear weights replaced: a symmetric 4-bit GPTQ linear without activation order
is a Q4_0 tensor exactly (Q4_0: blocks of 32 inputs, one fp16 scale d, w = d * (q - 8); GPTQ: w = scale[g] * (q -
8) with each group's scale repeated over its blocks), so the codes and scales are copied, not requantized, and
llama.cpp's dequantized weights equal the checkpoint's bit for bit. Where that cannot hold (asymmetric zeros,
activation order or a group not made of whole 32-wide blocks, scales not in fp16, another packing) the export
refuses in one line. The token embedding and output layer (tied in SmolLM2: one tensor, the output matmul reads it
whole for every drafted token) are Q8_0, as in llama.cpp's own Q4_0/Q4_1 files (Q6_K needs rows of 256; this
model's are 576): kept F32 they would be most of the draft's bytes, read for every drafted token. The draft's
outputs only set what is accepted, never the target's text. Every file is written to a temp path and renamed.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from infra.errors import PolyspecError

SDIST = "llama-cpp-python==0.3.36"
VERSION = SDIST.split("==")[1]
TOOLS = ("llama-speculative-simple", "llama-quantize", "llama-tokenize")
MARKER = ".polyspec-llamacpp"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CCACHE=OFF",
)
# ggml's x86 ISA options and the /proc/cpuinfo flags each needs; the first six are an AVX2 host's set (what the
# forced AVX2 paths build on an AVX-512 host)
AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")  # what GGML_AVX512 compiles for
ISA_FLAGS = {
    "GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",), "GGML_BMI2": ("bmi2",), "GGML_AVX_VNNI": ("avx_vnni",), "GGML_AVX512": AVX512_BASE,
    "GGML_AVX512_VBMI": (*AVX512_BASE, "avx512vbmi"), "GGML_AVX512_VNNI": (*AVX512_BASE, "avx512_vnni"),
    "GGML_AVX512_BF16": (*AVX512_BASE, "avx512_bf16"),
}
AVX2_LEVEL = tuple(ISA_FLAGS)[:6]
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
SIMD_FLAG = re.compile(r"^(avx|sse|ssse|fma|f16c|bmi|amx|vaes|vpclmul|gfni)")


class LlamaCppError(PolyspecError, RuntimeError):
    """llama.cpp could not be built or one of its tools failed; the message is one line and names the log."""


class GgufExportError(PolyspecError, ValueError):
    """A model that cannot be written as the GGUF asked for; the message is one line, meant for the user."""


def _cache_root() -> Path:
    """`<cache>/llamacpp`: the builds, the converter and the GGUF files."""
    from data.models import cache_dir

    return cache_dir() / "llamacpp"


def _temp_beside(out: Path) -> Path:
    """The temp path `out` is written to before it is renamed into place (one per process)."""
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(nothing on stderr)"


# ------------------------------------------------------------------------------------------------ building


def avx2_forced() -> bool:
    """The AVX2 paths forced on an AVX-512 host, by the setting torch's kernels and the project's own honour
    (ATEN_CPU_CAPABILITY=avx2): llama.cpp is then built for AVX2 too, so a side-by-side run compares like with like."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it lists none: not Linux on x86)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_kind() -> str:
    """`avx512-<hash>` / `avx2-<hash>` / `generic-<hash>`: the widest vector ISA and a hash of every SIMD flag;
    `avx2-forced` for the AVX2 build on an AVX-512 host (avx2_forced)."""
    flags = cpu_flags()
    simd = sorted(f for f in flags if SIMD_FLAG.match(f))
    widest = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "generic"
    if widest == "avx512" and avx2_forced():
        return "avx2-forced"
    return f"{widest}-{hashlib.sha256(' '.join(simd).encode()).hexdigest()[:8]}"


def isa_options(flags: set[str] | None = None) -> tuple[str, ...]:
    """The CMake ISA options for a CPU with these flags (default: this one's): on x86 each of ggml's instruction
    sets the flags have (the AVX2 level only where cpu_kind says it is forced), AMX off; GGML_NATIVE elsewhere."""
    flags = cpu_flags() if flags is None else flags
    if "sse2" not in flags:  # not x86: no AMX, and the native build is the one ggml tunes for that CPU
        return ("-DGGML_NATIVE=ON",)
    names = AVX2_LEVEL if "avx512f" in flags and avx2_forced() else tuple(ISA_FLAGS)
    chosen = [f"-D{name}={'ON' if name in names and set(ISA_FLAGS[name]) <= flags else 'OFF'}" for name in ISA_FLAGS]
    return ("-DGGML_NATIVE=OFF", *chosen, *AMX_OFF)


def default_folder() -> Path:
    """`<cache>/llamacpp/<version>-<cpu kind>-<hash of the build options>`: a build made with other options (the
    native AMX build that crashed) is never reused."""
    options = hashlib.sha256(" ".join((*CMAKE_OPTIONS, *isa_options())).encode()).hexdigest()[:8]
    return _cache_root() / f"{VERSION}-{cpu_kind()}-{options}"


def is_ready(folder: Path) -> bool:
    marker = folder / MARKER
    return marker.exists() and marker.read_text().strip() == SDIST and all((folder / "bin" / t).exists() for t in TOOLS)


def _step(args: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(args)}\n")
        fh.flush()
        try:
            done = subprocess.run(args, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
        except FileNotFoundError:
            raise LlamaCppError(f"building llama.cpp needs `{args[0]}`, which is not installed; see {log}") from None
    if done.returncode:
        raise LlamaCppError(f"building llama.cpp failed at `{' '.join(args[:3])}` (exit {done.returncode}); see {log}")


def _vendored_source(work: Path, log: Path, parts: tuple[str, ...] = ("",)) -> Path:
    """Download the sdist (pip, no build) and extract the `parts` of its vendored llama.cpp (paths under it that
    each member's path starts with; the default, all of it)."""
    _step([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SDIST,
           "-d", str(work)], log)
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        raise LlamaCppError(f"pip download of {SDIST} left no sdist in {work}; see {log}")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/" in m.name and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(parts)]
        tar.extractall(work / "src", members=members, filter="data")
    source = next((work / "src").glob("*/vendor/llama.cpp"), None)
    if source is None or not all((source / (part or "CMakeLists.txt")).exists() for part in parts):
        raise LlamaCppError(f"{sdist.name} vendors no llama.cpp with {', '.join(parts)}; see {log}")
    return source


def _remove_stale_work(parent: Path) -> None:
    """Work folders of builds that were killed (their pid is gone)."""
    for stale in parent.glob(".*.work-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _compile(source: Path, build: Path, log: Path, jobs: int) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _step(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_OPTIONS, *isa_options()], log)
    _step(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS], log)


def ensure_built(folder: Path | None = None, jobs: int | None = None) -> Path:
    """The folder of the built tools (`<folder>/bin`), building llama.cpp first when it is missing or unfinished
    (tens of minutes on two cores; ~1 GB of work space while it builds, a few MB after)."""
    folder = Path(folder or default_folder()).expanduser()
    if is_ready(folder):
        return folder / "bin"
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work(folder.parent)
    work = folder.parent / f".{folder.name}.work-{os.getpid()}"
    log = folder.with_name(f"{folder.name}-build.log")
    log.write_text("")
    print(f"llama.cpp: building {SDIST}'s vendored llama.cpp into {folder} (once; tens of minutes; log {log})",
          file=sys.stderr)
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        _compile(_vendored_source(work, log), work / "build", log, jobs or os.cpu_count() or 1)
        staging = work / "done"
        (staging / "bin").mkdir(parents=True)
        for tool in TOOLS:
            shutil.copy2(work / "build" / "bin" / tool, staging / "bin" / tool)
        (staging / MARKER).write_text(SDIST + "\n")
        if not is_ready(folder):  # another process may have finished the same build first
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder / "bin"


# ------------------------------------------------------------------------------------------------ converter

CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")  # llama.cpp's HF -> GGUF converter, as vendored


def converter_folder() -> Path:
    """Where llama.cpp's converter is kept: plain Python, the same on every CPU kind (beside the builds)."""
    return _cache_root() / f"{VERSION}-convert"


def ensure_converter(folder: Path | None = None) -> Path:
    """The folder holding llama.cpp's own `convert_hf_to_gguf.py` (with its `conversion/` package and `gguf-py/`),
    extracted once from the sdist, all-or-nothing as the build is."""
    folder = Path(folder or converter_folder()).expanduser()
    marker = folder / MARKER
    if marker.exists() and marker.read_text().strip() == SDIST:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work(folder.parent)
    work, log = folder.parent / f".{folder.name}.work-{os.getpid()}", folder.with_name(f"{folder.name}.log")
    log.write_text("")
    try:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        source = _vendored_source(work, log, CONVERTER)
        (source / MARKER).write_text(SDIST + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        source.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def convert_eagle3(head: Path, target: Path, out: Path, python: Path) -> Path:
    """An EAGLE-3 head folder (vLLM's layout) as the GGUF llama.cpp drafts with (`--spec-type draft-eagle3`),
    converted by llama.cpp's own converter unchanged: `convert_hf_to_gguf.py <head> --target-model-dir <target HF
    folder>`, run by `python` (an interpreter with torch, transformers and sentencepiece: the vLLM venv's); written
    to a temp path and renamed."""
    converter = ensure_converter()
    tmp = _temp_beside(out)
    args = [str(python), str(converter / CONVERTER[0]), str(head), "--target-model-dir", str(target),
            "--outfile", str(tmp), "--outtype", "f32"]
    done = subprocess.run(args, capture_output=True, text=True, errors="replace")  # it puts its gguf-py first
    if done.returncode or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"llama.cpp's convert_hf_to_gguf.py failed on {head} (exit {done.returncode}): "
                            f"{_last_line(done.stderr)}")
    tmp.replace(out)
    return out


# ------------------------------------------------------------------------------------------------ running

DRAFT_KINDS = ("draft-simple", "draft-eagle3")  # a draft model GGUF, or an EAGLE-3 head's GGUF (convert_eagle3)
NGRAM_KINDS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
# llama-speculative-simple needs a drafter; plain decoding gets one that never drafts: an n-gram lookup whose key is
# 1024 tokens (the longest it takes), which finds no earlier occurrence in a chat (and is checked to draft nothing)
NO_DRAFT = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024", "--spec-ngram-simple-size-m", "1"]
CONTEXT = 4096  # tokens of KV cache: a chat prompt and its reply, without llama.cpp's 8k default allocation


@dataclass(frozen=True)
class Speculation:
    """What llama-speculative-simple drafts with: nothing (plain greedy decoding: one target token per step), a
    draft GGUF (`draft-simple` for a draft model, `draft-eagle3` for an EAGLE-3 head; `draft_max` tokens per step),
    or an n-gram kind (NGRAM_KINDS) with its settings."""

    kind: str = "none"
    draft: Path | None = None
    draft_max: int = 4
    ngram: tuple[tuple[str, int], ...] = ()  # e.g. (("size-n", 3), ("size-m", 6)): --spec-<kind>-size-n 3 ...

    def args(self, threads: int) -> list[str]:
        if self.kind == "none":
            return list(NO_DRAFT)
        if self.kind in DRAFT_KINDS:
            if self.draft is None:
                raise LlamaCppError(f"speculation {self.kind} needs a draft GGUF")
            return ["--spec-type", self.kind, "-md", str(self.draft), "-td", str(threads),
                    "--spec-draft-n-max", str(self.draft_max)]
        if self.kind not in NGRAM_KINDS:
            raise LlamaCppError(f"unknown llama.cpp speculation {self.kind!r}; known: none, {', '.join(DRAFT_KINDS)}, "
                                f"{', '.join(NGRAM_KINDS)}")
        settings = [arg for key, value in self.ngram for arg in (f"--spec-{self.kind}-{key}", str(value))]
        return ["--spec-type", self.kind, *settings]


@dataclass(frozen=True)
class LlamaOutput:
    """One greedy decode by llama.cpp: the reply's text and what the tool reports about it."""

    text: str
    new_tokens: int  # tokens decoded, an end-of-generation token included
    prompt_tokens: int
    prompt_s: float  # the tool's time for the prompt (all of it but its last token)
    decode_s: float  # the tool's time for decoding (the last prompt token on)
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of prompt plus decoding, as polyspec's AR counts its prefill and decoding."""
        wall = self.prompt_s + self.decode_s
        return self.new_tokens / wall if wall > 0 else float("nan")

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def same_greedy(a: LlamaOutput, b: LlamaOutput, new_tokens: int) -> bool:
    """Whether two greedy decodes of one prompt agree. A drafting run may overshoot the token limit by part of
    its last accepted draft, so the longer text must extend the shorter, which must have reached the limit (or
    the two are equal, as when both ended at an end-of-generation token)."""
    if a.text == b.text:
        return True
    short, long = sorted((a, b), key=lambda out: len(out.text))
    return short.new_tokens >= new_tokens and long.text.startswith(short.text)


def pooled_acceptance(outs: list[LlamaOutput]) -> float | None:
    """The share of drafted tokens accepted over several decodes (None where none drafted)."""
    drafted = sum(o.drafted for o in outs)
    return sum(o.accepted for o in outs) / drafted if drafted else None


_REPORTED = {
    "encoded": re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def parse_output(stdout: str, stderr: str, prompt: str) -> LlamaOutput:
    """llama-speculative-simple's report: stdout is "\\n\\n" + the prompt's tokens + the reply (special tokens
    spelled out) + "\\n\\n" twice (after decoding, and at exit); stderr holds the counts and times."""
    found = {key: pattern.search(stderr) for key, pattern in _REPORTED.items()}
    if found["decoded"] is None or found["encoded"] is None:
        raise LlamaCppError("llama-speculative-simple printed no decoding report: " + _last_line(stderr))
    body = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not body.startswith(prompt):
        raise LlamaCppError(f"llama-speculative-simple echoed another prompt than it was given: {body[:80]!r}")
    return LlamaOutput(text=body[len(prompt):], new_tokens=int(found["decoded"][1]),
                       prompt_tokens=int(found["encoded"][1]), prompt_s=float(found["encoded"][2]),
                       decode_s=float(found["decoded"][2]),
                       drafted=int(found["drafted"][1]) if found["drafted"] else 0,
                       accepted=int(found["accepted"][1]) if found["accepted"] else 0)


def decode(tools: Path, model: Path, prompt: str, new_tokens: int, threads: int,
           speculation: Speculation = Speculation()) -> LlamaOutput:
    """Greedy decoding of `prompt` (text; special tokens such as <|im_start|> are parsed) with llama.cpp's
    llama-speculative-simple: `new_tokens` tokens (fewer at an end of generation), `threads` threads, drafting as
    `speculation` says (by default not at all: plain decoding in the same program, the fair AR). It runs in the
    caller's environment, so both engines of a comparison use the same OpenMP settings; the caller runs nothing of
    its own beside it (decode.bench gives llama.cpp a phase of its own)."""
    args = [str(tools / "llama-speculative-simple"), "-m", str(model), "-p", prompt, "-n", str(max(new_tokens - 1, 0)),
            "--temp", "0", "--seed", "0", "-t", str(threads), "-tb", str(threads), "-c", str(CONTEXT),
            *speculation.args(threads)]
    done = subprocess.run(args, capture_output=True, text=True, errors="replace")
    if done.returncode:
        raise LlamaCppError(f"llama-speculative-simple exited {done.returncode} on {model.name} "
                            f"({speculation.kind}): {_last_line(done.stderr)}")
    out = parse_output(done.stdout, done.stderr, prompt)
    if speculation.kind == "none" and out.drafted:
        raise LlamaCppError(f"plain decoding drafted {out.drafted} tokens (a 1024-token n-gram matched)")
    return out


def quantized(tools: Path, source: Path, kind: str) -> Path:
    """`source` (an F32 GGUF) quantized to `kind` (Q8_0, Q4_0, ...) by llama.cpp's own llama-quantize, as a user
    makes one; written once beside it (through a temporary file) and reused."""
    out = source.with_name(f"{source.stem.removesuffix('-F32')}-{kind}.gguf")
    if not out.exists():
        tmp = _temp_beside(out)
        done = subprocess.run([str(tools / "llama-quantize"), str(source), str(tmp), kind], capture_output=True,
                              text=True, errors="replace")
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise LlamaCppError(f"llama-quantize exited {done.returncode} on {source.name} ({kind}): "
                                f"{_last_line(done.stderr)}")
        tmp.rename(out)
    return out


def tokenize(tools: Path, model: Path, text: str) -> list[int]:
    """The token ids llama.cpp reads `text` as (special tokens parsed), as the decoding tools tokenize a prompt."""
    done = subprocess.run([str(tools / "llama-tokenize"), "-m", str(model), "-p", text, "--ids", "--log-disable"],
                          capture_output=True, text=True, errors="replace")
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode or not lines:
        raise LlamaCppError(f"llama-tokenize exited {done.returncode} on {model.name}: {_last_line(done.stderr)}")
    return [int(i) for i in lines[-1].strip("[]").split(",") if i.strip()]


# ------------------------------------------------------------------------------------ several ways per prompt

LLAMACPP_AR = "llamacpp_ar"  # llama.cpp's plain decoding, the reference of every other way it decodes


@dataclass
class LlamaPeer:
    """The llama.cpp engines to run per prompt, and what they produced (decode.bench's peer rows, decode.interop's
    llama.cpp checks)."""

    tools: Path
    target: Path
    threads: int
    engines: dict[str, Speculation]  # a sweep's engines are named "<family> k<draft length>"
    notes: dict[str, str]
    models: dict[str, Path] = field(default_factory=dict)  # engines that decode another file than `target`
    runs: dict[str, list[LlamaOutput]] = field(default_factory=dict)
    new_tokens: int = 0  # the token limit of the kept runs

    def decode_all(self, prompt: str, new_tokens: int, keep: bool = True) -> None:
        """Every engine once on `prompt`; kept for the table unless `keep` is false (warm-up)."""
        for name, speculation in self.engines.items():
            model = self.models.get(name, self.target)
            out = decode(self.tools, model, prompt, new_tokens, self.threads, speculation)
            if keep:
                self.runs.setdefault(name, []).append(out)
                self.new_tokens = new_tokens


def usable(enabled: Any, model: str, dtype: str, key: str) -> bool:
    """Whether llama.cpp is to run (`key`: auto | true | false): false, a target that is not the bundled fp32
    GGUF, or (auto) no build yet each make it off, with one line on stderr but for false."""
    if not (isinstance(enabled, bool) or enabled == "auto"):
        raise LlamaCppError(f"{key} must be auto, true or false, got {enabled!r}")
    if enabled is False:
        return False
    if not model.startswith("bundled:") or dtype != "float32":
        print(f"llama.cpp: off (it runs the bundled fp32 target only; model {model}, {dtype})", file=sys.stderr)
        return False
    if enabled == "auto" and not is_ready(default_folder()):
        print(f"llama.cpp: off (not built in {default_folder()}; {key}=true builds it, once, tens of minutes)",
              file=sys.stderr)
        return False
    return True


def bundled_target(model: str) -> Path:
    """The F32 GGUF of the bundled target `model` (`bundled:<name>`)."""
    return target_gguf(model.removeprefix("bundled:"))


# ------------------------------------------------------------------------------------------ GGUF: target

Q4_0_BLOCK = 32
ROPE_PERMUTED = {"attn_q": "llama.attention.head_count", "attn_k": "llama.attention.head_count_kv"}
Q8_0_TENSORS = ("token_embd.weight", "output.weight")  # quantized as llama-quantize does for a Q4_0 file
EXPORT = "linears Q4_0 exact, embeddings/output Q8_0"  # in w4_gguf's cache key: a new layout is a new file


def target_gguf(name: str = "smollm2-135m-instruct") -> Path:
    """The F32 GGUF of a bundled target (data.models.BUNDLED), written once and cached: every tensor dequantized
    by gguf's own dequantize, as transformers does when polyspec converts the same file (so the weights are the
    fp32 target's bit for bit, and no llama.cpp build is needed to make it)."""
    from data.models import BUNDLED, bundled_gguf

    source = bundled_gguf(name)
    out = _cache_root() / "gguf" / f"{name}-{importlib.metadata.version(BUNDLED[name][0])}-F32.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(source)
    tensors = {t.name: (t.data if t.tensor_type == gguf.GGMLQuantizationType.F32
                        else gguf.quants.dequantize(t.data, t.tensor_type), gguf.GGMLQuantizationType.F32)
               for t in reader.tensors}
    return _write_gguf(reader, tensors, gguf.LlamaFileType.ALL_F32, out)


def _write_gguf(reader: gguf.GGUFReader, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
                file_type: gguf.LlamaFileType, out: Path) -> Path:
    """A GGUF with the reader's metadata and tensor order, the given tensors (name -> data, type), written to a
    temp path and renamed to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(out)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        rewritten = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
        for item in reader.fields.values():
            if item.name.startswith("GGUF.") or item.name in rewritten:
                continue
            vtype = item.types[0]
            writer.add_key_value(item.name, item.contents(), vtype,
                                 sub_type=item.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        writer.add_file_type(file_type)
        for tensor in reader.tensors:
            data, dtype = tensors[tensor.name]
            writer.add_tensor(tensor.name, data, raw_dtype=dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ------------------------------------------------------------------------------------ GGUF: GPTQ -> Q4_0


@dataclass(frozen=True)
class GptqLinear:
    """One GPTQ (v1 packing) linear as stored: qweight [in/8, out], qzeros [groups, out/8], scales [groups, out]."""

    name: str
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor


def q4_0_rows(linear: GptqLinear) -> np.ndarray:
    """The linear's [out, in] weight as Q4_0 bytes, [out, in / 32 * 18]: codes and scales copied, refused in one
    line where Q4_0 cannot hold the GPTQ weight exactly."""
    from quantize.checkpoint import unpack_rows

    n_in, n_out = linear.g_idx.numel(), linear.scales.shape[1]
    if n_in % Q4_0_BLOCK:
        raise GgufExportError(f"{linear.name}: {n_in} inputs are not whole 32-wide Q4_0 blocks")
    block_groups = linear.g_idx.long().view(-1, Q4_0_BLOCK)
    if not torch.equal(block_groups, block_groups[:, :1].expand_as(block_groups)):
        raise GgufExportError(f"{linear.name}: a 32-wide block mixes GPTQ groups (activation order, or groups not made "
                              "of whole 32-wide blocks); Q4_0 has one scale per block")
    zeros = unpack_rows(linear.qzeros.t().contiguous(), 4).t()[:, :n_out] + 1
    if not torch.all(zeros == 8):
        raise GgufExportError(f"{linear.name}: asymmetric zero points; Q4_0 is symmetric (zero 8)")
    scales = linear.scales.to(torch.float16)
    if not torch.equal(scales.float(), linear.scales.float()):
        raise GgufExportError(f"{linear.name}: scales ({linear.scales.dtype}) are not all exact in fp16, "
                              "Q4_0's scale type")
    codes = unpack_rows(linear.qweight, 4)[:n_in].t().to(torch.uint8).contiguous()  # [out, in], 0..15
    blocks = codes.view(n_out, -1, Q4_0_BLOCK)
    packed = blocks[..., : Q4_0_BLOCK // 2] | (blocks[..., Q4_0_BLOCK // 2:] << 4)  # ggml: low nibbles first half
    d = scales[block_groups[:, 0]].t().contiguous()  # [out, blocks]
    rows = torch.cat([d.view(torch.uint8).view(n_out, -1, 2), packed], dim=-1)  # 2 bytes of scale, 16 of codes
    return rows.reshape(n_out, -1).numpy()


def rope_row_order(rows: int, heads: int) -> np.ndarray:
    """The row order convert_hf_to_gguf gives Llama's q/k weights (each head's two rotary halves interleaved,
    llama.cpp's rope layout): GGUF row i is HF row order[i]."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)


def gptq_linears(folder: Path) -> list[GptqLinear]:
    """Every quantized linear of a GPTQ checkpoint, after checking its config names what Q4_0 can hold."""
    try:
        quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        raise GgufExportError(f"{folder}: not a GPTQ checkpoint (no quantization_config in config.json)") from None
    wanted = {"quant_method": "gptq", "bits": 4, "sym": True, "desc_act": False}
    wrong = {k: quant.get(k) for k, v in wanted.items() if quant.get(k) != v}
    if quant.get("checkpoint_format", "gptq") != "gptq":
        wrong["checkpoint_format"] = quant.get("checkpoint_format")
    if wrong:
        raise GgufExportError(f"{folder}: Q4_0 holds symmetric 4-bit GPTQ without activation order exactly; "
                              f"this checkpoint has {wrong}")
    linears = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            keys = set(handle.keys())
            for prefix in sorted(k.removesuffix(".qweight") for k in keys if k.endswith(".qweight")):
                parts = {p: handle.get_tensor(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")}
                n_in = parts["qweight"].shape[0] * 8
                g_idx = (handle.get_tensor(f"{prefix}.g_idx") if f"{prefix}.g_idx" in keys  # static when absent
                         else torch.arange(n_in, dtype=torch.int32) // int(quant["group_size"]))
                linears.append(GptqLinear(prefix, g_idx=g_idx, **parts))
    if not linears:
        raise GgufExportError(f"{folder}: no quantized linear (no *.qweight) in its safetensors")
    return linears


# ------------------------------------------------------------------------------------ GGUF: the W4 level


def _gguf_weights(target: gguf.GGUFReader, linears: list[GptqLinear]) -> dict[str, np.ndarray]:
    """Each GPTQ linear as the Q4_0 rows of the target GGUF tensor it replaces (q/k rows in rope order)."""
    arch = str(target.fields[gguf.Keys.General.ARCHITECTURE].contents())
    if arch != "llama":
        raise GgufExportError(f"the target GGUF's architecture is {arch!r}; the W4 export maps Llama weights only")
    blocks = int(target.fields["llama.block_count"].contents())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, blocks)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in target.tensors}
    weights = {}
    for linear in linears:
        name = names.get_name(linear.name)
        n_in, n_out = linear.g_idx.numel(), linear.scales.shape[1]
        if name is None or shapes.get(f"{name}.weight") != (n_in, n_out):
            raise GgufExportError(f"{linear.name} ({n_out}x{n_in}) has no tensor of that shape in the target GGUF "
                                  f"(looked for {name}.weight): the W4 checkpoint is not of this target")
        rows = q4_0_rows(linear)
        kind = name.rsplit(".", 1)[-1]
        if kind in ROPE_PERMUTED:
            rows = rows[rope_row_order(n_out, int(target.fields[ROPE_PERMUTED[kind]].contents()))]
        weights[f"{name}.weight"] = rows
    return weights


def export_w4(gptq_folder: str | Path, target: str | Path, out: str | Path) -> Path:
    """Write the W4 level as a Q4_0 GGUF: the target GGUF's metadata, tokenizer and norms, its linear weights
    replaced by the GPTQ checkpoint's exactly (refused in one line where that cannot be exact), its embedding and
    output tensors in Q8_0 (q8_0_or_kept)."""
    reader = gguf.GGUFReader(target)
    weights = _gguf_weights(reader, gptq_linears(Path(gptq_folder)))
    tensors = {t.name: (weights[t.name], gguf.GGMLQuantizationType.Q4_0) if t.name in weights
               else q8_0_or_kept(t) for t in reader.tensors}
    return _write_gguf(reader, tensors, gguf.LlamaFileType.MOSTLY_Q4_0, Path(out))


def q8_0_or_kept(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """An F32 embedding or output tensor (Q8_0_TENSORS) whose rows are whole 32-wide blocks as Q8_0 (gguf's own
    quantizer, as the reference Q8_0 of llama.cpp); any other tensor as it is."""
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    if (tensor.name in Q8_0_TENSORS and tensor.tensor_type == gguf.GGMLQuantizationType.F32
            and tensor.data.ndim == 2 and tensor.data.shape[-1] % gguf.GGML_QUANT_SIZES[q8_0][0] == 0):
        return gguf.quants.quantize(np.asarray(tensor.data), q8_0), q8_0
    return tensor.data, tensor.tensor_type


def w4_gguf(gptq_folder: Path | None, target: Path) -> Path:
    """The W4 level's Q4_0 GGUF for a GPTQ checkpoint and target GGUF, exported once and cached by their content
    (the checkpoint's config and weights, the target file's name) and the export's layout (EXPORT)."""
    if gptq_folder is None or not (Path(gptq_folder) / "config.json").exists():
        raise GgufExportError(f"no W4 checkpoint at {gptq_folder}: run python -m quantize.w4")
    folder = Path(gptq_folder)
    digest = hashlib.sha256(f"{target.name} {EXPORT}".encode())
    for file in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        with file.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    out = _cache_root() / "gguf" / f"w4-{digest.hexdigest()[:16]}.Q4_0.gguf"
    return out if out.exists() else export_w4(folder, target, out)
