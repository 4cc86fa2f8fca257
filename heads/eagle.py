"""The EAGLE-2 draft head (the chain's drafter M3): exactly the function vLLM's EAGLE-1/2 model computes.

Pairing (EAGLE): `features[:, t]` is the verifier's last hidden state at position t (after its final
norm, i.e. `output_hidden_states[-1]`), `input_ids[:, t]` is the token at position t+1. The head
returns `hidden[:, t]`, its prediction of the feature at position t+1, and `logits[:, t]`, its
prediction of the token at position t+2.

The function is vLLM's `llama_eagle` (method "eagle"), which SGLang's `llama_eagle` and EAGLE's own
cnets.py also compute: `x = fc(cat[embed(token), feature])` with no bias (SGLang's and cnets' fc may
carry one), one decoder layer whose input norm is the identity, and its output (MLP output + residual)
is the predicted feature, with no final norm; the logits are the target's LM head on it. The decoder
layer is the target's own layer class, built from a one-layer copy of the target's config through the
public transformers API (Llama, Qwen2, Mistral, Gemma families); for a mixture-of-experts target (or one
whose layer is not Llama-style, GPT-NeoX) it is one dense Llama layer of the target's width, the head vLLM
and SGLang serve for such targets (head_layer). The embedding and LM head are the target's, frozen, held by
reference and never saved: `state_dict()` and `parameters()` hold the head's own weights only, under vLLM's names
(`fc.weight`, `layers.0.*`), which is also what DeepSpeed trains.

Draft vocabulary (FR-Spec / EAGLE-3): a head may carry `draft_vocab`, the sorted ids of the N tokens
it can propose (the most frequent ones in the training replies). Its logits then cover those N tokens
only, through the matching rows of the target's LM head: most of the head's cost on a small model is
that LM head, so N = V/6 makes a draft step several times cheaper. It is lossless by construction: a
token outside the subset has draft probability 0 and can only come from a verifier. It is a polyspec
option only: the weights are the same, the token map is saved beside them (draft_vocab.json), and
vLLM, which never reads it, drafts over the full vocabulary with the same weights.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infra.errors import PolyspecError
from infra.tracking import atomic_dir

FORMAT = "polyspec-eagle-head"
FORMAT_VERSION = 2  # 1: the pre-vLLM function (input norm, fc bias, final norm) in a private layout
DRAFT_VOCAB_FILE = "draft_vocab.json"  # not *.safetensors: vLLM loads every safetensors file of the folder


@dataclass(frozen=True)
class TrainingRecord:
    """What a saved head records of its training beside its weights: the features it was trained on, the training
    config, its metrics (metrics.json) and extra files (name -> bytes, e.g. a learning-curve PNG)."""

    feature_source: str = "target"
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


class HeadError(PolyspecError, RuntimeError):
    """An unusable target or a head that does not belong to the chain's target; one-line message."""


def _base_model(target: PreTrainedModel) -> nn.Module:
    return getattr(target, target.base_model_prefix, target)


LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
INPUT_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("qkv_proj",))  # the attention's input linears (Phi-3: fused)


def input_projections(layer: nn.Module) -> tuple[str, ...] | None:
    """The names of a decoder layer's attention input linears (q/k/v, or Phi-3's fused qkv), or None where the layer
    is not Llama's: other parts (LAYER_PARTS; GPT-NeoX's `attention` and fused query_key_value), or a cache taken
    under another name than `past_key_values` (GPT-NeoX's `layer_past`: the head's cache would go unwritten)."""
    if any(not isinstance(getattr(layer, part, None), nn.Module) for part in LAYER_PARTS):
        return None
    if "past_key_values" not in inspect.signature(type(layer).forward).parameters:
        return None
    return next((parts for parts in INPUT_PROJECTIONS
                 if all(isinstance(getattr(layer.self_attn, p, None), nn.Linear) for p in parts)), None)


def routes_to_experts(model: nn.Module) -> bool:
    """Whether a model's decoder layers route tokens through experts (Mixtral, Qwen3-MoE, gpt-oss): a module named
    `experts` in any layer."""
    layers = getattr(_base_model(model), "layers", None) or ()
    return any(name.rsplit(".", 1)[-1] == "experts" for name, _ in nn.ModuleList(layers).named_modules())


def dense_config(target_config: Any) -> Any:
    """A Llama config of the target's width, heads and rotary embedding, its MLP as wide as the target's
    `intermediate_size` (an expert's, or a dense layer's), rotating whole heads (Llama has no partial rotary): the
    one dense layer vLLM and SGLang load as a mixture-of-experts target's EAGLE head (EagleLlamaForCausalLM,
    LlamaForCausalLMEagle3)."""
    from transformers import LlamaConfig

    c = target_config
    heads = c.num_attention_heads
    rope = {k: v for k, v in (getattr(c, "rope_parameters", None) or {}).items() if k != "partial_rotary_factor"}
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", heads),
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_parameters=rope, attention_bias=getattr(c, "attention_bias", False),
        initializer_range=getattr(c, "initializer_range", 0.02), tie_word_embeddings=False,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        attn_implementation=c._attn_implementation)


def head_layer(target: PreTrainedModel) -> tuple[type, type, Any]:
    """(decoder-layer class, rotary-embedding class, one-layer config) of a target's head, or a one-line HeadError:
    the target's own layer class on a one-layer copy of its config where that layer is Llama-style; a dense Llama
    layer of its width (dense_config) where it routes tokens to experts or is built otherwise (GPT-NeoX)."""
    base = _base_model(target)
    layers, rotary = getattr(base, "layers", None), getattr(base, "rotary_emb", None)
    name = type(target).__name__
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or rotary is None:
        raise HeadError(
            f"target {name} has no usable decoder-layer class (an EAGLE head needs <base>.layers[0] "
            "and <base>.rotary_emb, as Llama/Qwen2/Mistral/Gemma models have)"
        )
    if routes_to_experts(target) or input_projections(layers[0]) is None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        return LlamaDecoderLayer, LlamaRotaryEmbedding, head_config(dense_config(target.config))
    layer_cls = type(layers[0])
    params = inspect.signature(layer_cls.__init__).parameters
    if "config" not in params or "layer_idx" not in params:
        raise HeadError(f"target {name}: decoder layer {layer_cls.__name__} cannot be built from (config, layer_idx)")
    return layer_cls, type(rotary), head_config(target.config)


def head_config(target_config: Any) -> Any:
    """A one-layer, full-attention copy of the target's config: the draft head's decoder layer."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    if config._attn_implementation not in ("eager", "sdpa"):
        config._attn_implementation = "sdpa"  # the head always passes an explicit 4-D float mask
    return config


class DraftHead(nn.Module):
    """What every draft head shares: the target's frozen input embedding (held by reference, never saved), an
    optional draft vocabulary (sorted target ids), the folder layout (config.json with polyspec's metadata beside
    vLLM's keys, model.safetensors) and the refusals on load. Subclasses: EagleHead (vLLM method "eagle"),
    heads.eagle3.Eagle3Head ("eagle3"). `forward(ids, features, cache, ...)` returns (hidden, logits, cache):
    `hidden` is what the next drafting step feeds back as its features."""

    method = ""

    def _share(self, target: PreTrainedModel, draft_vocab: torch.Tensor | None) -> None:
        """The target's embedding (frozen, not a submodule), its names, the draft vocabulary, the backend hook."""
        self._shared = {"embed": target.get_input_embeddings()}
        self._shared["embed"].requires_grad_(False)
        self.target_name = str(getattr(target.config, "name_or_path", "") or type(target).__name__)
        if draft_vocab is not None:
            draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).unique(sorted=True)
            if draft_vocab.numel() == 0 or draft_vocab[0] < 0 or draft_vocab[-1] >= self.config.vocab_size:
                raise HeadError(f"draft vocabulary must be token ids in [0, {self.config.vocab_size}), "
                                f"got {draft_vocab.numel()} ids")
            self.register_buffer("draft_vocab", draft_vocab, persistent=False)  # saved beside the weights or as d2t
        else:
            self.draft_vocab = None
        self._derived: dict[str, nn.Module] = {}  # modules built on first use (not saved)

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared["embed"]

    @property
    def feature_size(self) -> int:
        """Width of the features the level above hands this head (EAGLE: the hidden size)."""
        return self.config.hidden_size

    @classmethod
    def for_target(cls, target_model: PreTrainedModel, draft_vocab: torch.Tensor | None = None) -> "DraftHead":
        """An untrained head for a target (optionally with a draft vocabulary), in the target's dtype and device."""
        return _placed_like(cls(target_model, draft_vocab=draft_vocab), target_model)

    def step_inputs(self, input_ids: torch.LongTensor, past_key_values: Any, position_ids: torch.LongTensor | None,
                    attention_mask: torch.Tensor | None) -> tuple[torch.LongTensor, torch.Tensor]:
        """One forward's positions and additive mask in the head's dtype: past..past+T-1 and causal after the cached
        prefix where the caller gives none (a tree draft gives both)."""
        B, T = input_ids.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        dtype = self.fc.weight.dtype
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=input_ids.device).unsqueeze(0).expand(B, T)
        if attention_mask is None:
            attention_mask = causal_mask(T, past, dtype, input_ids.device)
        return position_ids, attention_mask.to(dtype)

    def position_embeddings(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the head's rotary embedding at these positions, in x's dtype (its layer attends fully)."""
        args = ("full_attention",) if self._rotary_takes_layer_type else ()
        return self.rotary_emb(x, position_ids, *args)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target token ids of positions in `logits`' last dimension."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """Probabilities over the draft vocabulary [..., N] spread onto the full vocabulary [..., V] (0 elsewhere)."""
        if self.draft_vocab is None:
            return probs
        return spread(probs, self.draft_vocab, self.config.vocab_size, 0.0)

    def save_pretrained(self, path: str | Path, target_hash: str, tokenizer: PreTrainedTokenizerBase | None = None,
                        record: TrainingRecord = TrainingRecord()) -> Path:
        """Write the folder vLLM loads as this method's head (config.json, model.safetensors: the head's weights under
        vLLM's names), metrics.json and the record's extra files; atomic (temp dir + rename)."""
        path, feature_source, training = Path(path), record.feature_source, record.training
        polyspec = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "method": self.method,
            "target": {"name": self.target_name, "weights_hash": target_hash,
                       "vocab_size": self.config.vocab_size, "hidden_size": self.config.hidden_size,
                       "vocab_hash": vocab_hash(tokenizer) if tokenizer is not None else None},
            "feature_source": feature_source,
            "draft_vocab": self._draft_vocab_meta(),
            "training": training,
        }
        files = {**self._vocab_files(), **record.files}
        with atomic_dir(path) as tmp:
            config = json.dumps(self.serving_config(polyspec), indent=2, sort_keys=True, default=str)
            (tmp / "config.json").write_text(config + "\n")
            save_file({k: v.detach().contiguous().cpu() for k, v in self.saved_tensors().items()},
                      str(tmp / "model.safetensors"), metadata={"format": "pt"})
            metrics = json.dumps(record.metrics, indent=2, sort_keys=True, default=float)
            (tmp / "metrics.json").write_text(metrics + "\n")
            for name, content in files.items():
                (tmp / name).write_bytes(content)
        return path

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())

    def _draft_vocab_meta(self) -> dict | None:
        return None if self.draft_vocab is None else {"file": DRAFT_VOCAB_FILE, "size": len(self.draft_vocab)}

    def _vocab_files(self) -> dict[str, bytes]:
        if self.draft_vocab is None:
            return {}
        return {DRAFT_VOCAB_FILE: (json.dumps(self.draft_vocab.tolist()) + "\n").encode()}

    def serving_config(self, polyspec: dict) -> dict:
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, path: str | Path, target_model: PreTrainedModel,
                        target_tokenizer: PreTrainedTokenizerBase | None = None) -> "DraftHead":
        """Load a saved head onto its target; refuses (HeadError) a head of another method, one trained for other
        weights or vocabulary, or one written in the old format (its function differs: it must be retrained)."""
        path = Path(path)
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise HeadError(f"{path}: not an EAGLE head folder (needs config.json and model.safetensors)")
        meta = read_metadata(path)
        method = meta.get("method") or "eagle"
        if method != cls.method:
            raise HeadError(f"{path}: an {method} head, not an {cls.method} one (a chain level or vLLM must use "
                            f"method {method} for it)")
        _check_target(path, meta, target_model, target_tokenizer)
        state = _read_weights(path / "model.safetensors")
        head = _placed_like(cls._saved(path, meta, target_model, state), target_model)
        try:
            missing, unexpected = head.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shape mismatches
            message = (str(err).splitlines() or [""])[-1].strip()
            raise HeadError(f"{path / 'model.safetensors'}: does not fit this target's head ({message})") from None
        if missing or unexpected:
            raise HeadError(f"{path / 'model.safetensors'}: does not fit this target's head "
                            f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
        head.feature_source = meta.get("feature_source", "target")
        return head.eval()

    @classmethod
    def _saved(cls, path: Path, meta: dict, target: PreTrainedModel, state: dict[str, torch.Tensor]) -> "DraftHead":
        """An empty head shaped as the saved one (its draft vocabulary read); `state` keeps only module weights."""
        return cls(target, draft_vocab=_read_draft_vocab(path, meta))


class EagleHead(DraftHead):
    """vLLM's EAGLE-1/2 function: fc(2h -> h, no bias) over [embed(token_{t+1}), feature_t], the target's
    decoder layer with an identity input norm, no final norm, the target's LM head."""

    method = "eagle"

    def __init__(self, target: PreTrainedModel, init_std: float | None = None, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        layer_cls, rotary_cls, self.config = head_layer(target)
        h = self.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        try:
            self.layers = nn.ModuleList([layer_cls(self.config, layer_idx=0)])
            self.rotary_emb = rotary_cls(config=self.config)
        except Exception as err:  # a layer class whose constructor needs more than its config
            raise HeadError(f"target {type(target).__name__}: cannot build {layer_cls.__name__} from its config "
                            f"({err.__class__.__name__}: {err})") from None
        if not isinstance(getattr(self.layer, "input_layernorm", None), nn.Module):
            raise HeadError(f"target {type(target).__name__}: decoder layer {layer_cls.__name__} has no "
                            "input_layernorm (the EAGLE head drops it)")
        self.layer.input_layernorm = nn.Identity()
        self._rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        std = init_std if init_std is not None else getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Shared with the target, frozen, deliberately not registered as submodules (not saved, not trained).
        self._share(target, draft_vocab)
        self._shared["lm_head"] = target.get_output_embeddings().requires_grad_(False)

    @property
    def layer(self) -> nn.Module:
        """The one decoder layer (`layers.0`, vLLM's name)."""
        return self.layers[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared["lm_head"]

    def forward(
        self,
        input_ids: torch.LongTensor,
        features: torch.Tensor,
        past_key_values: Any = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        compute_logits: bool = True,
        **attention: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """(predicted features [B,T,h], logits [B,T,V], cache). `attention_mask` is an additive float mask
        [B,1,T,past+T] (tree drafting); None means causal after the cached prefix. Positions default to
        past..past+T-1. The cache (e.g. DynamicCache) is extended in place. `compute_logits=False` returns
        None for logits (training applies the LM head to the loss positions only). `attention`: passed to the
        layer's attention (a static cache's `key_length`: decode.backends.cpu.attention)."""
        position_ids, attention_mask = self.step_inputs(input_ids, past_key_values, position_ids, attention_mask)
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(dtype), features.to(dtype)], dim=-1))
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=past_key_values is not None,
            position_embeddings=self.position_embeddings(x, position_ids),
            **attention,
        )
        out = out[0] if isinstance(out, tuple) else out  # MLP output + residual: the predicted feature, no final norm
        hidden = out.to(self.lm_head.weight.dtype)
        return hidden, self.logits(hidden) if compute_logits else None, past_key_values

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits of (predicted) features over the draft vocabulary (all V tokens if none): the target's LM
        head rows, with its logit soft-capping if any. Index i of the last dim is token `token_ids(i)`.
        `lm_head`: those rows as a backend runs them (Backend.prepare_head)."""
        if lm_head is None:
            lm_head = self.lm_head if self.draft_vocab is None else self._draft_lm_head()
        return softcapped(lm_head(hidden), self.config)

    def draft_rows(self) -> nn.Linear:
        """The target LM head's rows of the draft vocabulary, as a plain linear."""
        return vocabulary_rows(self.lm_head, self.draft_vocab)

    def _draft_lm_head(self) -> nn.Module:
        """`draft_rows`, built on first use (rebuilt if the head changed dtype)."""
        rows = self._derived.get("lm_head")
        if rows is None or rows.weight.dtype != self.lm_head.weight.dtype:
            self._derived["lm_head"] = rows = self.draft_rows()
        return rows

    def serving_config(self, polyspec: dict) -> dict:
        """config.json: the target's config cut to one layer (vLLM reads the architecture and sizes from it; a
        LlamaForCausalLM head becomes vLLM's EagleLlamaForCausalLM), the weights' dtype, and polyspec's own
        metadata under `polyspec`, a key vLLM and transformers ignore."""
        config = self.config.to_dict()
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING[type(self.config)].__name__  # the target's, or Llama's (dense)
        config.update(architectures=[architecture], num_hidden_layers=1,
                      dtype=str(self.fc.weight.dtype).removeprefix("torch."), polyspec=polyspec)
        config.pop("torch_dtype", None)
        return config


def _placed_like(head: DraftHead, target: PreTrainedModel) -> DraftHead:
    """The head in the target's dtype on the target's device (it reads the target's embeddings and LM head there)."""
    weight = next(target.parameters())
    return head.to(device=weight.device, dtype=weight.dtype)


def _first_line(err: BaseException) -> str:
    return f"{err.__class__.__name__}: {(str(err).splitlines() or [''])[0]}"


def read_metadata(path: Path) -> dict:
    """The `polyspec` section of a head's config.json; a one-line HeadError for anything else (an old-format head
    included)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        old = config.get("format") == FORMAT
        meta = config["polyspec"] if not old else config
        str(meta["target"]["weights_hash"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OSError) as err:  # ValueError: JSON, UTF-8
        raise HeadError(f"{path}/config.json: not an EAGLE head config ({_first_line(err)})") from None
    if old or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise HeadError(
            f"{path}: a {meta.get('format')} v{meta.get('format_version')} head, which computes another function than "
            f"this version's (v{FORMAT_VERSION}, vLLM's EAGLE head); retrain it with `python -m train.eagle`"
        )
    return meta


def _check_target(path: Path, meta: dict, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Refuse a head trained for other target weights, vocabulary size or tokenizer vocabulary."""
    from data.models import weights_hash

    expected, actual = meta["target"]["weights_hash"], weights_hash(target)
    if actual != expected:
        raise HeadError(
            f"{path}: head was trained for target weights {expected}, but the chain's target hashes to {actual}"
        )
    if meta["target"].get("vocab_size") != target.config.vocab_size:
        raise HeadError(
            f"{path}: head vocabulary size {meta['target'].get('vocab_size')} != target's {target.config.vocab_size}"
        )
    saved_vocab = meta["target"].get("vocab_hash")
    if tokenizer is not None and saved_vocab is not None and saved_vocab != vocab_hash(tokenizer):
        raise HeadError(f"{path}: head was trained with a different tokenizer vocabulary than the chain's target")


def _read_weights(weights: Path) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors, all finite; a one-line HeadError otherwise."""
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as err:  # truncated, empty or not a safetensors file
        raise HeadError(f"{weights}: unreadable ({_first_line(err)}); retrain or restore the head") from None
    from data.models import first_names, nonfinite_tensors

    bad = nonfinite_tensors(state)
    if bad:
        raise HeadError(f"{weights}: non-finite weights in {first_names(bad)} "
                        "(NaN or inf: a diverged training run?)")
    return state


def _read_draft_vocab(path: Path, meta: dict) -> torch.Tensor | None:
    """The saved draft vocabulary (sorted token ids), or None for a full-vocabulary head."""
    if meta.get("draft_vocab") is None:
        return None
    file = path / DRAFT_VOCAB_FILE
    try:
        ids = json.loads(file.read_text(encoding="utf-8"))
        vocab = torch.tensor(ids, dtype=torch.long)
        if vocab.dim() != 1 or len(vocab) != meta["draft_vocab"]["size"]:
            raise ValueError(f"{len(vocab)} ids, config.json says {meta['draft_vocab']['size']}")
    except (ValueError, KeyError, TypeError, RuntimeError, RecursionError, OSError) as err:
        raise HeadError(f"{file}: unreadable draft vocabulary ({_first_line(err)})") from None
    return vocab


def softcapped(logits: torch.Tensor, config: Any) -> torch.Tensor:
    """The model's final logit soft-capping (Gemma 2 style), where its config has one."""
    softcap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def spread(values: torch.Tensor, vocab: torch.Tensor, vocab_size: int, fill: float) -> torch.Tensor:
    """Values over a vocabulary subset [..., N] placed on the full vocabulary [..., vocab_size], `fill` elsewhere."""
    return values.new_full((*values.shape[:-1], vocab_size), fill).index_copy_(-1, vocab, values)


def vocabulary_rows(lm_head: nn.Module, vocab: torch.Tensor) -> nn.Linear:
    """A frozen linear holding the LM head's rows for `vocab`: logits over those tokens only, for a drafter or a
    middle level whose proposals are restricted to a vocabulary (a backend may then pack it)."""
    bias = getattr(lm_head, "bias", None)
    rows = nn.Linear(lm_head.weight.shape[1], len(vocab), bias=bias is not None, dtype=lm_head.weight.dtype)
    rows.weight = nn.Parameter(lm_head.weight.detach()[vocab].contiguous(), requires_grad=False)
    if bias is not None:
        rows.bias = nn.Parameter(bias.detach()[vocab].contiguous(), requires_grad=False)
    return rows


def vocab_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Content hash of a tokenizer's vocabulary (token -> id): a head only fits the vocabulary it learned."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def causal_mask(T: int, past: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive [1,1,T,past+T] mask: query i sees every cached key and the new keys up to itself."""
    allowed = torch.ones(T, past + T, dtype=torch.bool, device=device).tril(diagonal=past)
    return additive_mask(allowed, dtype)[None, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, the dtype's most negative value elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
