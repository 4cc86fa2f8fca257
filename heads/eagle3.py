"""The EAGLE-3 draft head: exactly the function vLLM's `llama_eagle3` (method "eagle3") and SGLang's compute.

Pairing as EAGLE-2's (heads.eagle): `features[:, t]` belongs to position t, `input_ids[:, t]` is token t+1,
`logits[:, t]` predicts token t+2. At the first step the features are the verifier's hidden states ENTERING its
layers `aux_layers` (default (2, N//2, N-3), HF's `output_hidden_states[i]`), side by side [B, T, 3h], and `fc`
(3h -> h, no bias) fuses them into g; at later steps the features are the head's own previous output, g itself
(the width tells which, as in vLLM). One decoder layer (heads.eagle.head_layer: the target's own class, or a dense
Llama one), its q/k/v widened to 2h:

    x = cat[input_layernorm(embed(token)), hidden_norm(g)]        (norm_before_residual: false)
    h = g + self_attn(x);  out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out));  `out` (before `norm`) is the next step's g.

The head owns its LM head over the draft vocabulary (`lm_head.weight` [draft_vocab, h], initialised from the
target's rows and trained); the embedding is the target's, frozen and never saved (vLLM and SGLang share the
target's). Saved under vLLM's names (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`) with, for a
draft vocabulary smaller than the target's, `d2t` (target id = draft id + d2t[draft id]) and `t2d` (bool [V]).
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.eagle import DraftHead, HeadError, head_layer, input_projections

ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's Eagle3LlamaForCausalLM, SGLang's LlamaForCausalLMEagle3


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 layers (2, N//2, N-3), kept inside [0, N) for targets shallower than 5 layers."""
    ids = (2, num_layers // 2, num_layers - 3)
    return tuple(min(max(i, 0), num_layers - 1) for i in ids)  # type: ignore[return-value]


def check_aux_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The layer ids as a tuple, or a one-line HeadError: each the index of a layer the target has."""
    layers = tuple(int(i) for i in layers)
    if not layers or any(not 0 <= i < num_layers for i in layers):
        raise HeadError(f"EAGLE-3 aux layers must be layer ids in [0, {num_layers}) of the target, got {list(layers)}")
    return layers


class Eagle3Head(DraftHead):
    """vLLM's EAGLE-3 function (module docstring) on the target's decoder-layer and RMSNorm classes."""

    method = "eagle3"

    def __init__(self, target: PreTrainedModel, init_std: float | None = None, draft_vocab: torch.Tensor | None = None,
                 aux_layers: Sequence[int] | None = None):
        super().__init__()
        layer_cls, rotary_cls, self.config = head_layer(target)
        n = target.config.num_hidden_layers
        self.aux_layers = check_aux_layers(aux_layers if aux_layers is not None else default_aux_layers(n), n)
        h = self.config.hidden_size
        self.fc = nn.Linear(len(self.aux_layers) * h, h, bias=False)
        self.midlayer = _widened_layer(target, layer_cls, self.config)
        norm_cls, eps = type(self.midlayer.input_layernorm), getattr(self.config, "rms_norm_eps", 1e-6)
        self.midlayer.hidden_norm = norm_cls(h, eps=eps)
        self.norm = norm_cls(h, eps=eps)
        self.rotary_emb = rotary_cls(config=self.config)
        self._rotary_takes_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self._share(target, draft_vocab)
        rows = target.get_output_embeddings().weight.detach()
        rows = rows if self.draft_vocab is None else rows[self.draft_vocab]
        self.lm_head = nn.Linear(h, rows.shape[0], bias=False, dtype=rows.dtype)
        std = init_std if init_std is not None else getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module is not self.lm_head:
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)  # the target's rows for the draft vocabulary, trained from there

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.config.hidden_size

    def forward(self, input_ids: torch.LongTensor, features: torch.Tensor, past_key_values: Any = None,
                position_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None, *,
                compute_logits: bool = True, **attention: Any) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """(pre-norm output g' [B,T,h], logits [B,T,draft vocab], cache). `features`: the verifier's aux states
        [B,T,3h] (fused by fc) or the head's previous output [B,T,h]. Masks, positions, cache and `attention` as
        EagleHead's."""
        position_ids, attention_mask = self.step_inputs(input_ids, past_key_values, position_ids, attention_mask)
        dtype = self.fc.weight.dtype
        g = features.to(dtype)
        if g.shape[-1] != self.config.hidden_size:
            g = self.fc(g)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed_tokens(input_ids).to(dtype)), layer.hidden_norm(g)], dim=-1)
        attended = layer.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=past_key_values is not None,
                                   position_embeddings=self.position_embeddings(g, position_ids), **attention)[0]
        h = g + attended  # the residual is g before hidden_norm (norm_before_residual: false)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return out, self.logits(out) if compute_logits else None, past_key_values

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits over the draft vocabulary of pre-norm outputs: lm_head(norm(hidden)); index i is `token_ids(i)`.
        (A backend packs lm_head with the head's other linears: decode.backends.Backend.prepare_head.)"""
        return (lm_head or self.lm_head)(self.norm(hidden))

    def draft_maps(self) -> dict[str, torch.Tensor]:
        """`d2t` (int64 [draft vocab]: target id - draft id) and `t2d` (bool [V]), for a reduced vocabulary only."""
        if self.draft_vocab is None:
            return {}
        vocab = self.draft_vocab.cpu()
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        return {"d2t": vocab - torch.arange(len(vocab)), "t2d": t2d}

    def saved_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.state_dict(), **self.draft_maps()}

    def _draft_vocab_meta(self) -> dict | None:
        return None if self.draft_vocab is None else {"file": "model.safetensors:d2t", "size": len(self.draft_vocab)}

    def _vocab_files(self) -> dict[str, bytes]:
        return {}

    def serving_config(self, polyspec: dict) -> dict:
        """config.json as vLLM and SGLang read an EAGLE-3 head: the target's sizes, one layer, the draft vocabulary's
        size, the aux layers, `norm_before_residual: false`; polyspec's metadata under `polyspec`."""
        config = self.config.to_dict()
        layers = list(self.aux_layers)
        config.update(architectures=[ARCHITECTURE], num_hidden_layers=1, tie_word_embeddings=False,
                      draft_vocab_size=self.lm_head.out_features, target_hidden_size=self.config.hidden_size,
                      norm_before_residual=False, eagle_aux_hidden_state_layer_ids=layers,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
                      dtype=str(self.fc.weight.dtype).removeprefix("torch."), polyspec=polyspec)
        config.pop("torch_dtype", None)
        config.pop("layer_types", None)
        return config

    @classmethod
    def _saved(cls, path: Path, meta: dict, target: PreTrainedModel, state: dict[str, torch.Tensor]) -> "Eagle3Head":
        """An empty head shaped as the saved one: aux layers from config.json, the draft vocabulary from d2t/t2d
        (taken out of `state`, checked against each other)."""
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        layers = config.get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(layers, list):
            raise HeadError(f"{path}/config.json: an EAGLE-3 head without eagle_aux_hidden_state_layer_ids")
        return cls(target, draft_vocab=_vocab_of(path, state, target.config.vocab_size), aux_layers=layers)


def _vocab_of(path: Path, state: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary d2t and t2d describe (taken out of `state`), None without them; HeadError if they
    disagree."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None and t2d is None:
        return None
    if d2t is None or t2d is None or d2t.dim() != 1 or t2d.shape != (vocab_size,):
        raise HeadError(f"{path}/model.safetensors: d2t and t2d must come together "
                        f"(d2t [draft vocab], t2d [{vocab_size}])")
    vocab = torch.arange(len(d2t)) + d2t.long()
    if not torch.equal(t2d.bool().nonzero().flatten(), vocab):
        raise HeadError(f"{path}/model.safetensors: d2t and t2d name different draft vocabularies")
    return vocab


def _widened_layer(target: PreTrainedModel, layer_cls: type, config: Any) -> nn.Module:
    """The head's decoder layer (head_layer: the target's class, or a dense Llama one) built from the head's one-layer
    config, q/k/v (or a fused qkv) reading 2h inputs."""
    try:
        layer = layer_cls(config, layer_idx=0)
    except Exception as err:  # a layer class whose constructor needs more than its config
        raise HeadError(f"target {type(target).__name__}: cannot build {layer_cls.__name__} from its config "
                        f"({err.__class__.__name__}: {err})") from None
    attention, inputs = layer.self_attn, input_projections(layer)
    for part in inputs:
        old = getattr(attention, part)
        setattr(attention, part, nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None))
    return layer


def load_head(path: str | Path, target: PreTrainedModel, tokenizer: Any = None, method: str | None = None) -> DraftHead:
    """A saved head of either method, read from its config.json (`method`, if given, must match it)."""
    from heads.eagle import EagleHead, read_metadata

    saved = read_metadata(Path(path)).get("method") or "eagle"
    cls = {"eagle": EagleHead, "eagle3": Eagle3Head}.get(method or saved)
    if cls is None:
        raise HeadError(f"{path}: unknown head method {method or saved!r} (eagle or eagle3)")
    return cls.from_pretrained(path, target, tokenizer)
