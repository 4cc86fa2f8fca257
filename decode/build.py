"""Chains from config (conf/decode/chain.yaml): load what every level names, then build each level complete.

Loading comes first, in level order, so that every level can be constructed with all it needs: a model level
read by an EAGLE level keeps its hidden states from the start, and a middle level restricted to the head's
draft vocabulary (`vocab: head`) gets it at construction, although the head is loaded after it.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data.artifacts import Artifacts
from data.cli import flag
from data.models import ModelSourceError, load_model, same_vocabulary
from decode import backends
from decode.backends.cpu import pack
from decode.backends.cpu.dense import packed_with
from decode.backends.cpu.int8 import quantize_lm_head
from decode.engine.chain import Chain, read_features
from decode.engine.head import EagleHead, vocabulary_rows
from decode.engine.levels import DecodeError, EagleLevel, Level, ModelLevel, NgramLevel

KINDS = ("model", "eagle", "ngram")


def gemm_choice(cfg: Any) -> str:
    """decode.gemm, checked: which packed product dense fp32 linears use (decode.backends.cpu.dense.gemm_for)."""
    gemm = cfg.decode.get("gemm", "auto")
    try:
        backends.gemm_choice(gemm, torch.device("cpu"))
    except (ValueError, RuntimeError) as err:  # an unknown name, or avx2 where it cannot run
        raise DecodeError(f"decode.{err}") from None
    return gemm


def onednn_target(cfg: Any, target: PreTrainedModel) -> PreTrainedModel | None:
    """The target packed with oneDNN, for a side-by-side row, when `target` itself runs on the AVX2 kernels."""
    if packed_with(target) != "avx2":
        return None
    model = load_model(cfg.model.name, cfg.model.dtype)[0]
    pack(model, "onednn")
    return model


def load_target(cfg: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The chain's target as configured: `model.name` in `model.dtype`, its linears packed when
    `decode.fast` (decode.fast: the AR reference and every chain then share that same configuration)."""
    gemm = gemm_choice(cfg)
    target, tokenizer = load_model(cfg.model.name, cfg.model.dtype)
    if cfg.decode.get("fast"):
        backends.prepare(target, gemm)
    return target, tokenizer


def configured_chain(cfg: Any, chain_cfg: list[dict], target_model: PreTrainedModel,
                     tokenizer: PreTrainedTokenizerBase) -> Chain:
    """`build_chain` with what the config says: the run's artifacts, model.dtype, decode.fast, decode.gemm
    and decode.draft_defaults."""
    return build_chain(chain_cfg, target_model, tokenizer, Artifacts.of(cfg), cfg.model.dtype,
                       flag(cfg.decode, "fast", default=False, error=DecodeError),
                       OmegaConf.to_container(cfg.decode.draft_defaults, resolve=True), gemm_choice(cfg))


def build_chain(
    chain_cfg: list[dict], target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
    artifacts: Artifacts | None = None, dtype: str = "float32", fast: bool = False, draft_defaults: dict | None = None,
    gemm: str = "auto",
) -> Chain:
    """Build a chain from level configs (a list from conf/decode/chain.yaml); level 1 is the target.

    Level keys: kind (model | eagle | ngram), name, mu (middle levels), draft (last level:
    {mode: chain, length} or {mode: tree, depth, top_k, total_tokens}; the keys it leaves out come from
    `draft_defaults`, by mode: decode.draft_defaults).
    model: `model` (`target`, a model spec or a folder: `w4` is the W4 stage's output, other relative folders
    are in the run dir, see data.artifacts; a GPTQ folder loads the same way), `dtype`, `layers` (keep the
    first n decoder layers: an early-exit copy sharing the weights, a stand-in drafter), `vocab: head` (a
    middle level restricted to the head's draft vocabulary), `lm_head: int8` (a drafting level's LM head on
    int8 weights). eagle: `path` (`eagle`, the head stage's
    output; another head folder; or `untrained`), `features` (nearest: the level above first, then upwards;
    target: the target first, then downwards). ngram: max_ngram, min_ngram. `artifacts` resolves the
    folders (None: relative to the working directory). `dtype` is the default for model levels that set
    none. `fast` packs the linears of every model level loaded here on the `gemm` product (decode.fast; pack
    the target itself with `load_target`).
    """
    if not chain_cfg:
        raise DecodeError("empty chain: list at least the target and one drafter")
    artifacts = artifacts or Artifacts(Path("."))
    configs = [_level_config(i, raw) for i, raw in enumerate(chain_cfg)]
    loaded = [_load(cfg, target_model, tokenizer, artifacts, dtype, gemm if fast else None) for cfg in configs]
    heads = [head for cfg, head in zip(configs, loaded) if cfg["kind"] == "eagle"]
    read = max((i for i, cfg in enumerate(configs) if cfg["kind"] == "eagle"), default=-1)  # levels above it keep features
    levels: list[Level] = []
    for i, (cfg, source) in enumerate(zip(configs, loaded)):
        name, draft = cfg.get("name") or f"L{i + 1}", _draft(cfg.get("draft"), draft_defaults or {})
        if cfg["kind"] == "model":
            vocab = None if cfg.get("vocab") is None else _level_vocab(cfg["vocab"], name, i, heads)
            rows = None if vocab is None else backends.linear_wrapper(source, gemm if fast else None)(
                vocabulary_rows(source.get_output_embeddings(), vocab))
            levels.append(ModelLevel(name, source, int(cfg.get("mu", 1)), draft, vocab=vocab, keep_hidden=i < read,
                                     runner=backends.runner(source), lm_head=rows))
        elif cfg["kind"] == "eagle":
            order = _feature_order(cfg.get("features"), name, source, [l for l in levels[::-1] if isinstance(l, ModelLevel)])
            features = read_features(order, target_model.config.hidden_size, target_model.dtype)
            levels.append(EagleLevel(name, source, features, draft))
        else:
            levels.append(NgramLevel(name, int(cfg.get("max_ngram", 3)), int(cfg.get("min_ngram", 1)), draft))
    return Chain(levels)


def _level_config(i: int, raw: dict) -> dict:
    """A level's config with its kind spelled out; level 1 must be the target."""
    cfg = dict(raw)
    cfg["kind"] = cfg.get("kind", "model")
    if i == 0 and (cfg["kind"] != "model" or cfg.get("model", "target") != "target" or cfg.get("layers")):
        raise DecodeError(f"level 1 must be the target ({{kind: model, model: target}}), got {raw}")
    if cfg["kind"] not in KINDS:
        raise DecodeError(f"level {i + 1} ({cfg.get('name') or f'L{i + 1}'}): unknown kind {cfg['kind']!r}; use model, eagle or ngram")
    return cfg


def _draft(draft: dict | None, defaults: dict) -> dict:
    """A level's draft with the keys it leaves out taken from `defaults` (by mode; mode is chain unless set)."""
    draft = {"mode": "chain", **(draft or {})}
    return {**defaults.get(draft["mode"], {}), **draft}


def _load(cfg: dict, target: PreTrainedModel, tokenizer, artifacts: Artifacts, dtype: str, gemm: str | None) -> Any:
    """What a level runs: its model (model levels), its head (eagle levels), nothing (ngram levels); packed
    on the `gemm` product unless that is None."""
    if cfg["kind"] == "model":
        model = level_model(cfg, target, tokenizer, artifacts, dtype)
        if model is not target:
            backends.prepare(model, gemm)
        if cfg.get("lm_head") is not None:
            _int8_lm_head(cfg, model, target)
        return model
    if cfg["kind"] == "eagle":
        head = _eagle_head(cfg, tokenizer, artifacts, target)
        backends.prepare(head, gemm)
        head.wrap_linear = backends.linear_wrapper(head, gemm)
        return head
    return None


def _int8_lm_head(cfg: dict, model: PreTrainedModel, target: PreTrainedModel) -> None:
    """`lm_head: int8`: a drafting level's LM head on int8 weights (decode.backends.cpu.int8.quantize_lm_head)."""
    name = cfg.get("name", cfg.get("model"))
    if cfg["lm_head"] != "int8":
        raise DecodeError(f"level {name!r}: lm_head must be int8 (or left out), got {cfg['lm_head']!r}")
    if model is target:
        raise DecodeError(f"level {name!r}: lm_head: int8 would change the target's own logits (and the output); "
                          "only a drafting level may have it")
    if not quantize_lm_head(model):
        raise DecodeError(f"level {name!r}: lm_head: int8 needs a bias-free CPU LM head and torch's int8 weight-only kernel")


def _feature_order(features: str | None, name: str, head: EagleHead, above: list[ModelLevel]) -> list[ModelLevel]:
    """The levels an EAGLE level reads features from, in the order it asks them (`above`: nearest first):
    `features` (nearest | target), by default what the head was trained on."""
    trained_on = getattr(head, "feature_source", None)
    source = features or ("target" if trained_on == "target" else "nearest")
    order = {"nearest": above, "target": above[::-1]}.get(source)
    if order is None:
        raise DecodeError(f"level {name!r}: features must be nearest or target, got {source!r}")
    return order


def _level_vocab(vocab: str, name: str, i: int, heads: list[EagleHead]) -> torch.Tensor:
    """A middle level's vocabulary (`vocab: head`): the draft vocabulary of the chain's EAGLE head."""
    if i == 0:
        raise DecodeError(f"level {name!r}: the target cannot have a restricted vocabulary (it would change the output)")
    if vocab != "head":
        raise DecodeError(f"level {name!r}: vocab must be 'head' (the EAGLE head's draft vocabulary), got {vocab!r}")
    vocabularies = [head.draft_vocab for head in heads if head.draft_vocab is not None]
    if not vocabularies:
        raise DecodeError(f"level {name!r}: vocab: head needs an EAGLE level whose head has a draft vocabulary")
    return vocabularies[0]


def level_model(cfg: dict, target: PreTrainedModel, tokenizer, artifacts: Artifacts, dtype: str) -> PreTrainedModel:
    """A model level's model: the target itself, or the model its `model:` names (checked against the
    target's vocabulary), cut to its first `layers` layers if set."""
    spec = str(cfg.get("model", "target"))
    if spec == "target":
        model = target
    else:
        spec = artifacts.model_spec(spec)  # a missing run artifact such as `w4` says "no such model folder"
        try:
            model, level_tokenizer = load_model(spec, dtype=str(cfg.get("dtype") or dtype))
        except ModelSourceError as err:
            raise DecodeError(f"level {cfg.get('name', spec)!r}: {err}") from None
        if not same_vocabulary(tokenizer, level_tokenizer):
            raise DecodeError(f"level {cfg.get('name', spec)!r}: {spec} has a different vocabulary than the target")
    if model.config.vocab_size != target.config.vocab_size:
        raise DecodeError(f"level {cfg.get('name', spec)!r}: vocab size {model.config.vocab_size} != target's {target.config.vocab_size}")
    if cfg.get("layers"):
        model = truncated_copy(model, int(cfg["layers"]))
    return model


def truncated_copy(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """The same model with only its first `layers` decoder layers (then the final norm and head).

    Shares every weight with `model`; a cheap, partially agreeing stand-in drafter."""
    total = model.config.num_hidden_layers
    if not 0 < layers < total:
        raise DecodeError(f"layers must be between 1 and {total - 1} for this model, got {layers}")
    decoder = model.get_decoder()
    kept = decoder.layers[:layers]
    full, decoder.layers = decoder.layers, torch.nn.ModuleList()
    try:
        clone = copy.deepcopy(model)  # copies everything but the (now empty) layer list
    finally:
        decoder.layers = full
    clone.get_decoder().layers = kept  # the same layer modules: weights are shared, not copied
    clone.config.num_hidden_layers = layers
    for attr in ("layer_types",):
        if getattr(clone.config, attr, None):
            setattr(clone.config, attr, clone.config.layer_types[:layers])
    return clone.eval()


def _eagle_head(cfg: dict, tokenizer, artifacts: Artifacts, target: PreTrainedModel) -> EagleHead:
    path = str(cfg.get("path", "eagle"))
    if path == "untrained":
        return EagleHead.for_target(target).eval()
    folder = artifacts.folder(path)
    if not folder.exists():
        raise DecodeError(f"{folder}: no EAGLE head folder (train one with python -m train.eagle)")
    try:
        return EagleHead.from_pretrained(str(folder), target, tokenizer).eval()
    except (OSError, ValueError, RuntimeError) as err:
        raise DecodeError(f"{folder}: cannot load the EAGLE head ({str(err).splitlines()[0]})") from None
