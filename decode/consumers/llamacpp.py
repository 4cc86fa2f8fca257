"""llama.cpp as a peer engine: built once from the llama.cpp that the `llama-cpp-python` sdist vendors, then run
as its own command-line tools (plain greedy decoding, speculative decoding with a draft GGUF, n-gram modes).

The build lives under the cache dir, one folder per sdist version, CPU kind and ISA options: on x86 the instruction
sets are named from /proc/cpuinfo's flags (GGML_NATIVE=OFF), since `-march=native` turns on ggml's AMX matmul on
an AMX host regardless of the GGML_AMX_* options, and that path dies with SIGILL (`tilezero` on an OpenMP worker,
Sapphire Rapids, 2026-11-26; ggml does ask Linux for the tile-data permission, so the cause is not found); AMX is
left out everywhere until it works. An AVX-512 build must not run on an AVX2-only machine; with the AVX2 paths
forced (ATEN_CPU_CAPABILITY=avx2) an AVX-512 host builds and runs an AVX2-only llama.cpp of its own. It is
all-or-nothing like the vLLM venv (decode/consumers/vllm_venv.py): everything is built in a work folder, the tools
are copied into a staging folder whose marker file is written last, and the staging folder is renamed into place;
a folder without the marker (a killed build) is rebuilt from scratch. The tools are linked statically, so they run
without LD_LIBRARY_PATH.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from infra.cli import PolyspecError

SDIST = "llama-cpp-python==0.3.36"
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
    from data.models import cache_dir

    version = SDIST.split("==")[1]
    options = hashlib.sha256(" ".join((*CMAKE_OPTIONS, *isa_options())).encode()).hexdigest()[:8]
    return cache_dir() / "llamacpp" / f"{version}-{cpu_kind()}-{options}"


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
    from data.models import cache_dir

    return cache_dir() / "llamacpp" / f"{SDIST.split('==')[1]}-convert"


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
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
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


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(nothing on stderr)"


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
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
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
