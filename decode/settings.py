"""The decode apps' door: `decode.*` (and model, device, run_dir) read once into frozen values, checked before any
model loads. Everything below the apps takes these values; none of it sees a config."""
from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.settings import DataSettings, ModelSettings, data_of, model_of
from infra.cli import flag
from decode.backends import Backend, BackendFieldError
from decode.backends.cpu.dense import GEMMS
from decode.engine.chain import check_new_tokens
from decode.engine.errors import DecodeError
from decode.engine.sampling import Sampling
from decode.engine.spec import ChainSpec, SpecError
from decode.evaluation import EvalError
from decode.evaluation.speedup import IntervalError, checked_confidence
from decode.publish import Publication
from infra.device import checked_threads
from infra.layout import RunLayout
from infra.schema import NonNegative, Positive
from infra.settings import Tracking, checked, device_of, layout_of, parse, plain, tracking_of

_SURROGATE = re.compile("[\ud800-\udfff]")
BACKEND_KEYS = {"native_fp32": "native_fp32", "native_w4": "native", "activations": "w4_activations",
                "w4_kernel": "w4_kernel", "runner": "backend"}


@dataclass(frozen=True)
class DecodeSection:
    """decode.*'s own keys (bench, costs and chains have their own values)."""

    chain: str = "polybasic"
    prompt: Any = None
    prompt_file: str | None = None
    max_new_tokens: Any = 128
    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    seed: Any = 0
    fast: bool = False
    gemm: str = "auto"
    native: str = "auto"
    native_fp32: str = "auto"
    w4_activations: str = "int8"
    w4_kernel: str = "auto"
    backend: str = "auto"
    threads: Any = None
    compare_ar: bool = False
    draft_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decoding:
    """What every decode app shares: the target (`model`, as data's door reads it, on `device`), how models run
    (`backend`; nothing packed without decode.fast), how tokens are drawn, the run's folders, the named chains as
    specs, and decode.*'s own keys (`section`: fast, threads, the chain to run, draft_defaults); `verbose`: the
    libraries' own output (GPTQModel's as a W4 level loads) on the terminal, not in the run's library_logs."""

    model: ModelSettings
    device: torch.device
    layout: RunLayout
    run_name: str
    backend: Backend
    sampling: Sampling
    chains: dict[str, ChainSpec]
    section: DecodeSection
    verbose: bool = False

    def chatter_log(self) -> Path | None:
        """Where the libraries' own output goes (infra.logs.chatter_to): the run's library_logs, or the terminal."""
        return None if self.verbose else self.layout.library_logs / "decode.log"

    def spec(self, name: str) -> ChainSpec:
        """decode.chains[name], or the one-line DecodeError naming the chains there are."""
        if name not in self.chains:
            raise DecodeError(f"decode.chain={name!r}: no such chain in conf/decode/chain.yaml; "
                              f"known: {', '.join(self.chains)}")
        return self.chains[name]

    def parse_chain(self, levels: Any, where: str = "chain") -> ChainSpec:
        """A level list (a config's or a manifest's) as a spec, the drafter's missing draft keys from draft_defaults."""
        return ChainSpec.parse(plain(levels), self.section.draft_defaults, where)


def gemm_choice(gemm: Any, device: torch.device) -> str | None:
    """decode.gemm checked by name: which packed product dense fp32 linears use; None off the CPU (nothing is packed
    there). Whether avx2 builds here is known once its kernels are built, when the target loads (load_target)."""
    if gemm not in GEMMS:
        raise DecodeError(f"decode.gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    return gemm if device.type == "cpu" else None


def backend_of(d: DecodeSection, device: torch.device) -> Backend:
    """How the run's models run: nothing packed and nothing native without decode.fast, nothing packed off the CPU;
    decode.w4_kernel either way; decode.backend=static (aoti): every model level on the compiled static runner (the
    GPU's code path on any device; aoti: compiled ahead of time), nothing native, a CPU's linears and attention on
    the project's kernels where decode.fast packs them; eager: nothing compiled on CUDA. Backend checks its own
    values; a wrong one is named by its config key."""
    gemm = gemm_choice(d.gemm, device)
    try:
        if d.backend in ("static", "aoti"):
            return Backend(gemm if d.fast else None, w4_kernel=d.w4_kernel, runner=d.backend)
        if not d.fast:
            return Backend(w4_kernel=d.w4_kernel, runner=d.backend)
        return Backend(gemm, d.native_fp32, d.native, d.w4_activations, d.w4_kernel, d.backend)
    except BackendFieldError as err:
        raise DecodeError(f"decode.{BACKEND_KEYS[err.field]} {err.problem}") from None


def sampling_of(d: DecodeSection) -> Sampling:
    """decode.temperature / top_k / top_p / seed as one Sampling, or a one-line DecodeError naming the key."""
    args = {key: getattr(d, key) for key in ("temperature", "top_k", "top_p", "seed")}
    for key in ("temperature", "top_p"):
        if isinstance(args[key], int) and not isinstance(args[key], bool):
            args[key] = float(args[key])
    try:
        return Sampling(**args)
    except DecodeError as err:
        raise DecodeError(f"decode.{err}") from None


def decode_section(cfg: Any) -> DecodeSection:
    d = cfg.decode
    try:
        own = {key: plain(d.get(key)) for key in (f.name for f in dataclasses.fields(DecodeSection)) if key in d}
    except OmegaConfBaseException as err:  # an interpolation in decode.prompt that does not resolve
        raise DecodeError(f"decode.prompt: cannot resolve it ({err.__class__.__name__}); pass text with prompt=\"...\" "
                          "or decode.prompt_file=PATH, which are taken literally") from None
    return parse(DecodeSection, own, "decode", DecodeError)


def decoding_of(cfg: Any) -> Decoding:
    """decode.*, model.*, device and run_dir as one Decoding, every value and every named chain checked."""
    d = decode_section(cfg)
    checked_threads(d.threads, "decode.threads")
    device = device_of(cfg)
    chains = {}
    for name, levels in (cfg.decode.get("chains") or {}).items():
        if levels is not None:
            try:
                chains[name] = ChainSpec.parse(plain(levels), d.draft_defaults, f"decode.chains.{name}")
            except SpecError as err:
                raise DecodeError(str(err)) from None
    return Decoding(model=model_of(cfg), device=device, layout=layout_of(cfg), run_name=str(cfg.get("run_name", "")),
                    backend=backend_of(d, device), sampling=sampling_of(d), chains=chains, section=d,
                    verbose=flag(cfg, "verbose", False, DecodeError))


@dataclass(frozen=True)
class GenerateSettings:
    """decode.generate's run: the shared decoding, the user message, the token budget, whether to compare with AR."""

    decoding: Decoding
    prompt: str
    max_new_tokens: int
    compare_ar: bool


def generate_of(cfg: Any) -> GenerateSettings:
    """decode.generate's settings; the prompt read (a file or stdin) and every value checked before any model loads."""
    decoding = decoding_of(cfg)
    d = decoding.section
    new_tokens = max_new_tokens(d.max_new_tokens)
    return GenerateSettings(decoding, prompt_text(d.prompt, d.prompt_file), new_tokens, d.compare_ar)


def max_new_tokens(value: Any) -> int:
    """decode.max_new_tokens, or the one-line DecodeError naming it."""
    try:
        check_new_tokens(value)
    except DecodeError as err:
        raise DecodeError(f"decode.{err}") from None
    return int(value)


def prompt_text(prompt: Any, prompt_file: str | None) -> str:
    """The user message: the file `decode.prompt_file` read literally (`-` = stdin; UTF-8, a byte order mark
    and one final newline dropped), or `decode.prompt` (the `prompt=` shorthand makes that literal too;
    a plain `decode.prompt=` override is Hydra syntax, where `${...}` is an interpolation)."""
    if prompt is not None and prompt_file is not None:
        raise DecodeError("decode.prompt and decode.prompt_file are both set; give one")
    if prompt_file is not None:
        where = "decode.prompt_file=-" if str(prompt_file) == "-" else f"decode.prompt_file={prompt_file}"
        try:
            data = (sys.stdin.buffer.read() if str(prompt_file) == "-"
                    else Path(str(prompt_file)).expanduser().read_bytes())
        except OSError as err:
            raise DecodeError(f"{where}: cannot read ({err.strerror or err.__class__.__name__})") from None
        try:
            prompt = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        except UnicodeDecodeError as err:
            raise DecodeError(f"{where}: not UTF-8 text (byte {err.start + 1})") from None
        prompt = prompt[:-2] if prompt.endswith("\r\n") else prompt[:-1] if prompt.endswith("\n") else prompt
    else:
        where = "decode.prompt"
    if prompt_file is not None and not prompt.strip():
        raise DecodeError(f"{where}: no prompt in it (empty)")
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        raise DecodeError('no prompt: python -m decode.generate prompt="your question"')
    if not isinstance(prompt, (str, int, float)) or isinstance(prompt, bool):
        raise DecodeError(f"decode.prompt must be text, got {type(prompt).__name__}; quote it: prompt=\"...\"")
    prompt = str(prompt)
    if _SURROGATE.search(prompt):
        raise DecodeError(f"{where}: not valid UTF-8 text (undecodable bytes or lone surrogates)")
    return prompt


@dataclass(frozen=True)
class PlanSettings:
    """eval.plan: which chains the planner calibrates, on what, and the knobs it tries."""

    enabled: bool = True
    chains: tuple[str, ...] | None = None
    questions: Positive = 4
    max_new_tokens: Positive = 32
    mu: tuple[Positive, ...] = (1, 2, 3, 4, 6, 8)
    lengths: tuple[Positive, ...] = (1, 2, 3, 4, 6, 8)
    min_gain: float = 0.03
    trees: tuple[dict[str, int], ...] = ()
    costs: Path | None = None
    ks: tuple[Positive, ...] = (1, 2, 3, 4, 5, 6, 8, 16, 32)
    repeats: Positive = 5
    context: Positive = 192
    stacks: NonNegative = 2  # 0: plan only the configured chains


@dataclass(frozen=True)
class CheckSettings:
    """eval.checks, with the near-tie tolerance of the target's dtype and the eval's confidence."""

    near_tie_relative: dict[str, float]
    insertion_rule: Literal["both", "theorem", "direct"] = "both"
    agreement_tolerance: float = 0.10
    agreement_prediction: Literal["refined", "paper"] = "refined"
    confidence: float = 0.95

    def near_tie(self, dtype: str) -> float:
        if dtype not in self.near_tie_relative:
            raise EvalError(f"eval.checks.near_tie_relative has no tolerance for dtype {dtype!r}")
        return self.near_tie_relative[dtype]


@dataclass(frozen=True)
class Theorem33:
    questions: int = 3
    temperature: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Artifact:
    name: str
    type: str


@dataclass(frozen=True)
class PublishSettings:
    chain: str = "best"
    dir: Path = Path("publish")
    force: bool = False
    lineage: tuple[Artifact, ...] = ()


@dataclass(frozen=True)
class EvalSection:
    prompts: str | None = None
    per_category: Positive | None = 2
    max_new_tokens: Positive = 64
    warmup_tokens: NonNegative = 16
    out_dir: Path = Path("eval")
    confidence: Any = 0.95
    chains: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    plan: PlanSettings = PlanSettings()
    theorem_3_3: Theorem33 = Theorem33()
    publish: PublishSettings = PublishSettings()


@dataclass(frozen=True)
class EvalSettings:
    """decode.eval's run: the shared decoding, the chains it compares (as specs), and eval.*."""

    decoding: Decoding
    specs: dict[str, ChainSpec]
    checks: CheckSettings
    section: EvalSection
    publication: Publication
    tracking: Tracking
    config: dict[str, Any]  # eval.* as plain data, recorded in the report

    @property
    def plan(self) -> PlanSettings:
        return self.section.plan

    @property
    def publish(self) -> PublishSettings:
        return self.section.publish


def confidence_of(value: Any, section: str, error: type[Exception]) -> float:
    """A `confidence` setting of `section` (eval, decode.bench), or the one-line error naming it."""
    try:
        return checked_confidence(value)
    except IntervalError as err:
        raise error(f"{section}.{err}") from None


def eval_of(cfg: Any) -> EvalSettings:
    """decode.eval's settings, every check of its inputs done before anything loads."""
    section = parse(EvalSection, plain(cfg.eval), "eval", EvalError)
    confidence = confidence_of(section.confidence, "eval", EvalError)
    if section.publish.chain != "best" and section.chains.get(section.publish.chain) is None:
        raise EvalError(f"eval.publish.chain={section.publish.chain!r} is not one of eval.chains "
                        f"({', '.join(section.chains)}) nor 'best'")
    decoding = decoding_of(cfg)
    checks = parse(CheckSettings, {**section.checks, "confidence": confidence}, "eval.checks", EvalError)
    checks.near_tie(decoding.model.dtype)
    specs = {}
    for name, levels in section.chains.items():
        if name == "ar":
            raise EvalError("eval.chains: 'ar' is reserved for the autoregressive reference")
        if levels is not None:  # a chain switched off from the command line (eval.chains.polybasic=null)
            specs[name] = decoding.parse_chain(levels, f"eval.chains.{name}")
    if not specs:
        raise EvalError("eval.chains is empty: nothing to evaluate")
    publication = Publication(decoding.model.name, decoding.model.dtype, decoding.run_name, decoding.layout,
                              section.publish.dir, llamacpp_draft_max(cfg, DecodeError))
    return EvalSettings(decoding, specs, checks, section, publication, tracking_of(cfg), plain(cfg.eval))


@dataclass(frozen=True)
class LlamaCppBench:
    """decode.bench.llamacpp: llama.cpp beside polyspec (decode.bench's peer rows)."""

    enabled: Any = "auto"
    draft_max: Positive = 4
    ngram: dict[str, Any] = field(default_factory=dict)
    sweep: tuple[Positive, ...] = (2, 4, 6, 8)


@dataclass(frozen=True)
class BenchSection:
    prompts: str | None = None
    per_category: Positive | None = 1
    max_new_tokens: Positive = 64
    repeats: Positive = 1
    confidence: Any = 0.95
    warmup_tokens: NonNegative = 8
    two_level: str | None = None
    three_level: str | None = None
    extra: tuple[str, ...] = ()
    stand_ins: dict[str, str] = field(default_factory=dict)
    assistant: dict[str, Any] | None = None
    assistant_stand_in: dict[str, Any] | None = None
    prompt_lookup_num_tokens: Positive = 6
    llamacpp: LlamaCppBench | None = None
    out: Path = Path("bench.json")


@dataclass(frozen=True)
class BenchSettings:
    """decode.bench's run: the shared decoding, decode.bench.* and its interval's confidence."""

    decoding: Decoding
    section: BenchSection
    confidence: float
    config: dict[str, Any]  # decode.bench.* as plain data, recorded in bench.json


def bench_of(cfg: Any) -> BenchSettings:
    section = parse(BenchSection, plain(cfg.decode.bench), "decode.bench", DecodeError)
    return BenchSettings(decoding_of(cfg), section, confidence_of(section.confidence, "decode.bench", DecodeError),
                         plain(cfg.decode.bench))


@dataclass(frozen=True)
class CostsSection:
    ks: tuple[Positive, ...] = (1, 2, 4, 8, 12, 16)
    context: Positive = 256
    repeats: Positive = 9
    head_vocab: tuple[Positive | None, ...] = ()
    round_tokens: Positive = 64
    out: Path = Path("costs.json")


@dataclass(frozen=True)
class CostsSettings:
    """decode.costs' run: the shared decoding, decode.costs.*, and the conversations its context comes from."""

    decoding: Decoding
    section: CostsSection
    data: DataSettings


def costs_of(cfg: Any) -> CostsSettings:
    section = parse(CostsSection, plain(cfg.decode.costs), "decode.costs", DecodeError)
    return CostsSettings(decoding_of(cfg), section, data_of(cfg))


@dataclass(frozen=True)
class InteropChecks:
    """interop.checks: whether (b) and (c) run, and how close the engines must come to polyspec."""

    acceptance: bool = True
    w4: bool = True
    acceptance_tolerance: float = 0.10
    agreement_tolerance: float = 0.05
    agreement_alpha: float = 0.01


@dataclass(frozen=True)
class InteropSection:
    """interop.* (conf/interop/default.yaml says what each is)."""

    out: Path
    venv: Path | None = None
    bundle: Path | None = None
    head: Path | None = None
    w4: Path | None = None
    num_speculative_tokens: Positive = 3
    prompts: str | None = None
    per_category: Positive = 1
    max_new_tokens: Positive = 64
    warmup_tokens: NonNegative = 8
    threads: Positive = 2
    max_model_len: Positive = 1024
    dtype: str = "float32"
    w4_dtype: str = "bfloat16"
    ngram: dict[str, int] = field(default_factory=lambda: {"prompt_lookup_max": 3, "prompt_lookup_min": 1})
    llamacpp: bool | Literal["auto"] = False
    checks: InteropChecks = InteropChecks()


@dataclass(frozen=True)
class InteropSettings:
    """decode.interop's run: the decoding polyspec's side shares with the other apps, interop.*, the bundle whose
    head and W4 level are checked (interop.bundle, else eval.publish.dir)."""

    decoding: Decoding
    section: InteropSection
    bundle: Path
    config: dict[str, Any]  # interop.* as plain data, recorded in interop.json
    llamacpp_draft_max: int  # the W4 GGUF's draft length in the bundle's llama.cpp serve command


def llamacpp_draft_max(cfg: Any, error: type[Exception]) -> int:
    """decode.bench.llamacpp.draft_max: the W4 GGUF's tokens a step in the llama.cpp serve command a bundle publishes,
    and so the length decode.interop measures that draft at."""
    return checked(Positive, OmegaConf.select(cfg, "decode.bench.llamacpp.draft_max", default=4),
                   "decode.bench.llamacpp.draft_max", error)


def interop_of(cfg: Any) -> InteropSettings:
    """decode.interop's settings, checked before anything is installed or loaded; the counts and switches are
    refused with the messages users know from the command line."""
    from decode.engines import InteropError

    raw = plain(cfg.interop)
    for key in ("acceptance", "w4"):
        flag(cfg.interop.checks, key, error=InteropError)
    if not (isinstance(raw.get("llamacpp", False), bool) or raw["llamacpp"] == "auto"):
        raise InteropError(f"interop.llamacpp must be auto, true or false, got {raw['llamacpp']!r}")
    section = parse(InteropSection, raw, "interop", InteropError)
    bundle = section.bundle or checked(Path, plain(cfg.eval.publish.dir), "eval.publish.dir", InteropError)
    return InteropSettings(decoding_of(cfg), section, bundle, raw, llamacpp_draft_max(cfg, InteropError))
