"""Chains from config (conf/decode/chain.yaml): load what every level names, then build each level complete.

Loading comes first, in level order, so that every level can be constructed with all it needs: a model level
read by an EAGLE level keeps its hidden states from the start, and a middle level restricted to the head's
draft vocabulary (`vocab: head`) gets it at construction, although the head is loaded after it.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from data.models import ModelSourceError, load_model, resolve_model_path, same_vocabulary
from decode.backends import Backend, int8_fallback
from decode.backends.cpu import pack
from decode.backends.cpu.dense import gemm_for, packed_with
from decode.backends.cpu.int8 import quantize_lm_head
from decode.engine.chain import Chain, read_features
from decode.engine.errors import DecodeError
from decode.engine.levels import EagleLevel, Level, LevelCompute, ModelLevel, NgramLevel
from decode.engine.runner import Prepared, as_prepared
from decode.engine.sampling import GREEDY, Sampling
from decode.engine.spec import ChainSpec, LevelSpec
from infra.logs import chatter_to
from heads.eagle import DraftHead, EagleHead, vocabulary_rows
from heads.eagle3 import Eagle3Head, load_head
from infra.layout import RunLayout

if TYPE_CHECKING:
    from decode.settings import Decoding


def load_target(decoding: Decoding) -> tuple[Prepared, PreTrainedTokenizerBase]:
    """The chain's target as configured: `model` in `dtype` on `device`, prepared by the run's backend (packed, and
    run natively per decode.native_fp32), which the AR reference and every chain share."""
    if decoding.backend.gemm == "avx2":
        try:
            gemm_for(torch.float32, "avx2")  # builds the kernels on first use
        except RuntimeError as err:  # avx2 where it cannot run
            raise DecodeError(f"decode.{err}") from None
    target, tokenizer = load_model(decoding.model.name, decoding.model.dtype, decoding.device)
    try:
        return decoding.backend.prepare(target), tokenizer
    except ValueError as err:  # native_fp32=on where the native runner cannot run the target
        raise DecodeError(f"decode.{err}") from None


def onednn_target(decoding: Decoding, target: PreTrainedModel) -> PreTrainedModel | None:
    """The target packed with oneDNN, for a side-by-side row, when `target` itself runs on the AVX2 kernels."""
    if packed_with(target) != "avx2":
        return None
    model = load_model(decoding.model.name, decoding.model.dtype)[0]
    pack(model, "onednn")
    return model


def eos_of(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int | list[int] | None:
    """The stop tokens of every decoder of a run (chains and references alike): the target's generation config's,
    else its tokenizer's."""
    eos = target.generation_config.eos_token_id
    return eos if eos is not None else tokenizer.eos_token_id


def reference_decoders(decoding: Decoding, target: Prepared, eos: Any, sampling: Sampling = GREEDY,
                       others: dict[str, PreTrainedModel] | None = None) -> dict[str, Callable]:
    """The autoregressive reference on the configured target (`ar`), and beside it AR on the plain eager target
    (`ar_eager`, when decode.fast, where the two differ) and on each of `others` by name (the bench's oneDNN one)."""
    from decode.chains.baselines import autoregressive

    models: dict[str, Prepared | PreTrainedModel] = {"ar": target}
    if decoding.section.fast:
        models["ar_eager"] = load_model(decoding.model.name, decoding.model.dtype, target.model.device)[0]
    models |= others or {}
    runners = {name: as_prepared(model).new_runner() for name, model in models.items()}  # one each, reused
    return {name: (lambda p, n, s=sampling, m=model, r=runners[name]: autoregressive(m, p, n, s, eos, r))
            for name, model in models.items()}


def builder_for(decoding: Decoding, target: Prepared, tokenizer: PreTrainedTokenizerBase) -> ChainBuilder:
    """A builder for the run: its artifacts, model dtype and backend."""
    return ChainBuilder(target, tokenizer, decoding.layout,
                        LevelSettings(decoding.model.dtype, decoding.backend, decoding.chatter_log()))


@dataclass(frozen=True)
class LevelSettings:
    """How the levels a builder loads run: `dtype` their default dtype, `backend` how they run (the target is
    prepared already: load_target); `chatter`: where a loading library's own output goes (infra.logs.chatter_to)."""

    dtype: str = "float32"
    backend: Backend = Backend()
    chatter: Path | None = None


class ChainBuilder:
    """Chains for one target from specs. Every model or head is loaded once, the first time a spec names it, and
    shared by every chain built here (a planned variant of a chain costs no load); levels are built complete.
    `artifacts` resolves folders (None: relative to the working directory)."""

    def __init__(self, target: PreTrainedModel | Prepared, tokenizer: PreTrainedTokenizerBase | None,
                 artifacts: RunLayout | None = None, settings: LevelSettings = LevelSettings()):
        target = as_prepared(target)
        self.prepared_target, self.target, self.tokenizer = target, target.model, tokenizer
        self.dtype, self.backend = settings.dtype, settings.backend.drafting(target)
        self.chatter = settings.chatter
        self.artifacts = artifacts or RunLayout(Path("."))
        self._loaded: dict[tuple, Any] = {}

    def build(self, spec: ChainSpec) -> Chain:
        loaded = [self.load(level) for level in spec.levels]
        shapes = _level_shapes(spec, loaded)  # the whole spec checked before any level is built
        levels: list[Level] = []
        for level, source, shape in zip(spec.levels, loaded, shapes):
            levels.append(self._level(level, source, shape, levels))
        return Chain(levels)

    def load(self, level: LevelSpec) -> Any:
        """What a level runs, loaded once: its prepared model (model levels), its head as the backend runs it (eagle
        levels), nothing (ngram)."""
        key = (level.kind, level.model, level.dtype, level.layers, level.lm_head, level.path, level.method,
               level.weights)
        if level.kind != "ngram" and key not in self._loaded:
            self._loaded[key] = self._load(level)
        return self._loaded.get(key)

    def _load(self, level: LevelSpec) -> Any:
        if level.kind == "model":
            with chatter_to(self.chatter):  # GPTQModel's banners and tables as a W4 level loads
                model = level_model(level, self.target, self.tokenizer, self.artifacts, self.dtype, self.backend.load)
            if level.lm_head is not None:
                _int8_lm_head(level, model, self.target)
            if model is self.target:
                return self.prepared_target
            try:
                return self.backend.prepare(model)
            except ValueError as err:  # native=on where the native runner cannot run a W4 level
                raise DecodeError(f"decode.{err}") from None
        return self.backend.prepare_head(_eagle_head(level, self.tokenizer, self.artifacts, self.target), level.weights)

    def _level(self, level: LevelSpec, source: Any, shape: LevelShape, above: list[Level]) -> Level:
        """One level of one chain (`above`: the levels built before it): a model level gets a new runner of the
        prepared model (its KV cache is the level's), an EAGLE level a new head runner."""
        if level.kind == "model":
            rows = None if shape.vocab is None else self.backend.linear(
                source.model, vocabulary_rows(source.lm_head, shape.vocab))
            return ModelLevel(level.name, source, level.mu, level.draft, shape.vocab,
                              LevelCompute(lm_head=rows)).keeping(shape.keep_hidden)
        if level.kind == "eagle":
            nearest_first = [built for built in above[::-1] if isinstance(built, ModelLevel)]
            order = nearest_first[::-1] if shape.target_first else nearest_first
            features = read_features(order, source.head.feature_size, self.target.dtype)
            return EagleLevel(level.name, source, features, level.draft)
        return NgramLevel(level.name, level.max_ngram, level.min_ngram, level.draft)


@dataclass(frozen=True)
class LevelShape:
    """What the rest of the spec decides about one level: what a model level keeps for the EAGLE level below it and
    its vocabulary (`vocab: head`); whether an EAGLE level reads the target's features before the nearest level's."""

    keep_hidden: bool | tuple[int, ...] = False
    vocab: torch.Tensor | None = None
    target_first: bool = False


def _level_shapes(spec: ChainSpec, loaded: list[Any]) -> list[LevelShape]:
    """Each level's shape; one DecodeError where the levels do not fit together."""
    heads = [source.head for level, source in zip(spec.levels, loaded) if level.kind == "eagle"]
    # the levels above the last EAGLE level keep features for it
    read = max((i for i, level in enumerate(spec.levels) if level.kind == "eagle"), default=-1)
    kept = heads[-1].aux_layers if heads and isinstance(heads[-1], Eagle3Head) else True  # what they keep
    shapes = []
    for i, (level, source) in enumerate(zip(spec.levels, loaded)):
        if level.kind == "model":
            vocab = None if level.vocab is None else _level_vocab(level, heads, is_target=i == 0)
            shapes.append(LevelShape(keep_hidden=_checked_keep(level, source, kept if i < read else False),
                                     vocab=vocab))
        elif level.kind == "eagle":
            shapes.append(LevelShape(target_first=_reads_target_first(level.features, source.head)))
        else:
            shapes.append(LevelShape())
    return shapes


def _int8_lm_head(level: LevelSpec, model: PreTrainedModel, target: PreTrainedModel) -> None:
    """`lm_head: int8`: a drafting level's LM head on int8 weights (decode.backends.cpu.int8.quantize_lm_head), a CPU
    kernel; off the CPU the level keeps its own LM head (decode.backends.int8_fallback), said once (a drafter's head
    never changes the output)."""
    name = level.name
    if model is target:
        raise DecodeError(f"level {name!r}: lm_head: int8 would change the target's own logits (and the output); "
                          "only a drafting level may have it")
    fallback = int8_fallback("lm_head: int8", f"level {name!r}", model.device, model.dtype)
    if fallback is not None:
        print(fallback, file=sys.stderr)
        return
    if not quantize_lm_head(model):
        raise DecodeError(
            f"level {name!r}: lm_head: int8 needs a bias-free CPU LM head and torch's int8 weight-only kernel"
        )


def _checked_keep(level: LevelSpec, model: Prepared, keep: bool | tuple[int, ...]) -> bool | tuple[int, ...]:
    """What a model level keeps for the EAGLE level below: EAGLE-3's aux layers need a model that has them."""
    layers = model.model.config.num_hidden_layers
    if isinstance(keep, tuple) and max(keep) >= layers:
        raise DecodeError(f"level {level.name!r}: the EAGLE-3 head reads the states entering layers {list(keep)}, "
                          f"but this level's model has {layers} layers")
    return keep


def _reads_target_first(features: str | None, head: DraftHead) -> bool:
    """Where an EAGLE level reads its features first: `features` (nearest | target), by default where the head was
    trained."""
    trained_on = getattr(head, "feature_source", None)
    return (features or ("target" if trained_on == "target" else "nearest")) == "target"


def _level_vocab(level: LevelSpec, heads: list[DraftHead], is_target: bool) -> torch.Tensor:
    """A middle level's vocabulary (`vocab: head`): the draft vocabulary of the chain's EAGLE head."""
    name = level.name
    if is_target:
        raise DecodeError(
            f"level {name!r}: the target cannot have a restricted vocabulary (it would change the output)"
        )
    vocabularies = [head.draft_vocab for head in heads if head.draft_vocab is not None]
    if not vocabularies:
        raise DecodeError(f"level {name!r}: vocab: head needs an EAGLE level whose head has a draft vocabulary")
    return vocabularies[0]


def level_model(
    level: LevelSpec, target: PreTrainedModel, tokenizer, artifacts: RunLayout, dtype: str,
    load: Callable[..., tuple[PreTrainedModel, PreTrainedTokenizerBase]] = load_model,
) -> PreTrainedModel:
    """A model level's model: the target itself, or the model its `model:` names, loaded by `load` (a backend's: a
    GPTQ folder may run torch's int4 kernels) and checked against the target's vocabulary, on the target's device,
    cut to its first `layers` layers if set."""
    spec, name = level.model, level.name
    if spec == "target":
        model = target
    else:
        spec = artifacts.model_spec(spec)  # a missing run artifact such as `w4` says "no such model folder"
        try:
            model, level_tokenizer = load(spec, level.dtype or dtype, target.device)
        except (ModelSourceError, ValueError) as err:  # ValueError: a checkpoint torch's int4 kernels cannot take
            raise DecodeError(f"level {name!r}: {err}") from None
        if not same_vocabulary(tokenizer, level_tokenizer):
            raise DecodeError(f"level {name!r}: {spec} has a different vocabulary than the target")
    if model.config.vocab_size != target.config.vocab_size:
        raise DecodeError(
            f"level {name!r}: vocab size {model.config.vocab_size} != target's {target.config.vocab_size}"
        )
    if level.layers:
        try:
            model = truncated_copy(model, level.layers)
        except DecodeError as err:
            raise DecodeError(f"level {name!r}: {err} (the level's `layers`)") from None
    return model


def layer_count(spec: str) -> int | None:
    """The decoder layers of the model `spec` names, read from its config.json; None where it is no local folder yet
    (a hub id, a W4 model not made yet: its loader says so)."""
    from transformers import AutoConfig

    try:
        path = Path(resolve_model_path(spec))
    except ModelSourceError:
        return None
    if not (path / "config.json").is_file():
        return None
    return AutoConfig.from_pretrained(path).get_text_config().num_hidden_layers


def refuse_unfit_layers(spec: ChainSpec, where: str, target: str, artifacts: RunLayout) -> None:
    """Early-exit levels (`layers: n`) checked against the config.json of the model they cut before any model loads,
    refused in one line naming the setting to change (`decode.chains.standin3.1.layers`): a shallow model has fewer
    layers than the shipped stand-ins cut to."""
    for i, level in enumerate(spec.levels):
        if level.kind != "model" or not level.layers:
            continue
        total = layer_count(target if level.model == "target" else artifacts.model_spec(level.model))
        if total is not None and not 0 < level.layers < total:
            fix = f"set it between 1 and {total - 1}" if total > 1 else "a 1-layer model has none to leave out"
            raise DecodeError(f"{where}.{i}.layers={level.layers}: level {level.name!r} is an early-exit copy of a "
                              f"model of {total} layers; {fix}")


def truncated_copy(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """The same model with only its first `layers` decoder layers (then the final norm and head).

    Shares every weight with `model`; a cheap, partially agreeing stand-in drafter."""
    total = model.config.num_hidden_layers
    if not 0 < layers < total:
        raise DecodeError(f"layers must be between 1 and {total - 1} for this model, got {layers}")
    decoder = model.get_decoder()
    # the layers keep one set of transformers' output-capturing hooks: hooked once here, the copy inherits the mark,
    # where a copy hooking its layers again would change what a compiled forward of `model` was guarded on
    maybe_install_capturing_hooks(decoder)
    kept = decoder.layers[:layers]
    full, decoder.layers = decoder.layers, torch.nn.ModuleList()
    try:
        clone = copy.deepcopy(model)  # copies everything but the (now empty) layer list
    finally:
        decoder.layers = full
    clone.get_decoder().layers = kept  # the same layer modules: weights are shared, not copied
    clone.config.num_hidden_layers = layers
    if getattr(clone.config, "layer_types", None):
        clone.config.layer_types = clone.config.layer_types[:layers]
    return clone.eval()


def _eagle_head(level: LevelSpec, tokenizer, artifacts: RunLayout, target: PreTrainedModel) -> DraftHead:
    """An eagle level's head: untrained (`method` eagle or eagle3) or loaded, of the method its folder says."""
    path = level.path
    if path == "untrained":
        return (Eagle3Head if level.method == "eagle3" else EagleHead).for_target(target).eval()
    folder = artifacts.folder(path)
    if not folder.exists():
        raise DecodeError(f"{folder}: no EAGLE head folder (train one with python -m train.eagle)")
    try:
        return load_head(folder, target, tokenizer, level.method).eval()
    except (OSError, ValueError, RuntimeError) as err:
        raise DecodeError(f"{folder}: cannot load the EAGLE head ({str(err).splitlines()[0]})") from None
