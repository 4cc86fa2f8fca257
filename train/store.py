"""The feature store: the verifier's hidden states over the training conversations, computed once.

Online features cost a full verifier forward per token and per epoch, several times the head's own
step on a CPU; stored once, later epochs pay only the head. The store lives in
`<root>/<key>/` as safetensors shards (`features` [tokens, h] and `lengths` [examples]; for an EAGLE-3 head also
`aux` [tokens, 3h], the states entering its aux layers, and `argmax` [tokens], the verifier's next token) plus a
meta.json. The key hashes everything the features depend on: the feature model's weights, the
tokenized examples (data source, selection, max length, chat template), the stored dtype and aux layers. A store
under another key is never read (it is removed, with a message); an interrupted build keeps the
shards it finished in `<key>.partial/` and continues from them. With several ranks, each builds every
world-th shard and rank 0 publishes the folder.

The cross-entropy target needs no storing: it is the verifier's distribution at the next position,
i.e. its LM head applied to the stored next feature, which training computes over the draft
vocabulary only (cheap). Only EAGLE-3's mask (is the verifier's own next token in the draft vocabulary?) needs
its argmax over the full vocabulary, which is stored. Each example is a dict of these tensors.
"""
from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from infra.cli import PolyspecError
from train.distributed import Share
from train.settings import StoreDtype

SHARD_EXAMPLES = 64


class StoreError(PolyspecError, RuntimeError):
    """A feature store that cannot be used as it is; one-line message."""
STORE_DTYPES = {name: getattr(torch, name) for name in get_args(StoreDtype)}


def store_key(feature_hash: str, sequences: list[torch.Tensor], dtype: str, aux_layers: tuple[int, ...] = ()) -> str:
    digest = hashlib.sha256(f"{feature_hash}|{dtype}{f'|aux{list(aux_layers)}' if aux_layers else ''}".encode())
    for ids in sequences:
        digest.update(ids.numpy().tobytes() + b"|")
    return digest.hexdigest()[:16]


@torch.inference_mode()
def _features(model: PreTrainedModel, sequences: list[torch.Tensor], batch: int,
              aux_layers: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """Each sequence's last hidden states (and with aux layers: the states entering them side by side, and the
    verifier's argmax); batched by similar length (right padding, causal: exact rows)."""
    base = getattr(model, model.base_model_prefix, model)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[dict | None] = [None] * len(sequences)
    for start in range(0, len(order), batch):
        group = order[start:start + batch]
        width = max(len(sequences[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(sequences[i])], attn[row, :len(sequences[i])] = sequences[i], 1
        result = base(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                      output_hidden_states=bool(aux_layers))
        parts = {"features": result.last_hidden_state}
        if aux_layers:
            parts["aux"] = torch.cat([result.hidden_states[i] for i in aux_layers], -1)
            head = model.get_output_embeddings()
            parts["argmax"] = torch.stack([head(row).argmax(-1) for row in result.last_hidden_state])
        for row, i in enumerate(group):  # the store lives in host memory
            out[i] = {k: v[row, :len(sequences[i])].cpu() for k, v in parts.items()}
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class FeatureSource:
    """The model the head's features come from (the target, or the W4 model) and its weights hash; `compute_dtype`:
    the dtype of a copy of it that computes the store instead (None: the model itself)."""

    model: PreTrainedModel
    weights_hash: str
    compute_dtype: torch.dtype | None = None

    def computing_model(self) -> PreTrainedModel:
        """The model that computes the store, copied only now: a store that exists needs no copy."""
        return self.model if self.compute_dtype is None else copy.deepcopy(self.model).to(self.compute_dtype)


@dataclass(frozen=True)
class StoreSettings:
    """Where and how a store is kept: its folder's parent, the stored dtype (float32 | bfloat16), the batch of its
    forwards, and the layers whose entering states it also keeps (EAGLE-3's aux states; () for EAGLE-2)."""

    root: Path
    dtype: str = "bfloat16"
    batch: int = 8
    aux_layers: tuple[int, ...] = ()


def computing_in(source: FeatureSource, compute: str) -> FeatureSource:
    """The model that computes the store (`train.store_compute`): the feature model itself ("model", or a model already
    in bfloat16), or a bfloat16 copy of it, whose store is keyed apart (its features are another function's)."""
    if compute == "model" or source.model.dtype == torch.bfloat16:
        return source
    return FeatureSource(source.model, f"{source.weights_hash}|bfloat16", torch.bfloat16)


def build_or_load(source: FeatureSource, sequences: list[torch.Tensor], settings: StoreSettings,
                  share: Share = Share(), known: list[torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """Per-sequence {"features": [len, h]} in the settings' dtype (with aux layers also "aux" [len, 3h] and
    "argmax" [len]), from the store under its root (built first if missing, each rank computing its share, or from
    `known`: each sequence's features, already computed by the source's model, with no aux layers)."""
    aux_layers = tuple(settings.aux_layers)
    key = store_key(source.weights_hash, sequences, settings.dtype, aux_layers)
    folder = settings.root / key
    if not (folder / "meta.json").is_file():
        _build(source.computing_model(), sequences, key, replace(settings, aux_layers=aux_layers), share, known)
    elif share.rank == 0:
        meta = json.loads((folder / "meta.json").read_text())
        print(f"feature store: reusing {folder} (built at {meta.get('tokens_per_s', 0):,.0f} tokens/s on "
              f"{meta.get('device', '?')})")
    return _load(folder, len(sequences))


def _build(model: PreTrainedModel, sequences: list[torch.Tensor], key: str, settings: StoreSettings,
           share: Share, known: list[torch.Tensor] | None) -> None:
    root, dtype, batch, aux_layers = settings.root, STORE_DTYPES[settings.dtype], settings.batch, settings.aux_layers
    rank, world = share.rank, share.world
    partial = root / f"{key}.partial"
    tokens, h = sum(len(s) for s in sequences), model.config.hidden_size
    width = h * (1 + len(aux_layers))  # values per token: the last hidden state and the aux states
    shards = range(0, len(sequences), SHARD_EXAMPLES)
    if rank == 0:
        for stale in root.glob("*") if root.is_dir() else []:
            if stale.name not in (key, partial.name):
                print(f"feature store: removing {stale} (built for other weights, data or settings)")
                shutil.rmtree(stale, ignore_errors=True)
        print(f"feature store: {len(sequences):,} conversations, {tokens:,} tokens x {width} x {dtype} = "
              f"{tokens * width * dtype.itemsize / 2**20:,.1f} MiB in {root / key}"
              f"{' (the features of the forwards that wrote the replies)' if known is not None else ''}")
    partial.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    mine = [s for n, s in enumerate(shards) if n % world == rank]
    bar = tqdm(total=sum(len(t) for s in mine for t in sequences[s:s + SHARD_EXAMPLES]), unit="tok",
               desc="feature store", disable=rank != 0, dynamic_ncols=True)
    for start in mine:
        part = sequences[start:start + SHARD_EXAMPLES]
        shard = partial / f"shard-{start // SHARD_EXAMPLES:05d}.safetensors"
        if not shard.is_file():  # shards finished by an interrupted build are kept
            if known is not None:
                computed = [{"features": f} for f in known[start:start + SHARD_EXAMPLES]]
            else:
                computed = _features(model, part, batch, aux_layers) if aux_layers else _features(model, part, batch)
            tensors = {k: torch.cat([c[k] for c in computed]) for k in computed[0]}
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
            tmp = shard.with_name(f".{shard.name}.tmp")
            save_file({**tensors, "lengths": torch.tensor([len(s) for s in part])}, str(tmp))
            tmp.replace(shard)
        bar.update(sum(len(s) for s in part))
    bar.close()
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        # all ranks' shards done (the barrier); shards kept from before included
        seconds = time.perf_counter() - started
        meta = {"key": key, "conversations": len(sequences), "tokens": tokens, "hidden_size": h,
                "aux_layers": list(aux_layers), "dtype": str(dtype).removeprefix("torch."),
                "shard_examples": SHARD_EXAMPLES, "device": str(model.device),
                "build_seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
        print(f"feature store: built in {seconds:.1f} s on {model.device} "
              f"({tokens / max(seconds, 1e-9):,.0f} tokens/s)")
        (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        partial.rename(root / key)
    if dist.is_initialized():
        dist.barrier()


def _load(folder: Path, count: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = []
    for shard in sorted(folder.glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        lengths = tensors.pop("lengths").tolist()
        split = {k: torch.split(v, lengths) for k, v in tensors.items()}
        out += [{k: v[i] for k, v in split.items()} for i in range(len(lengths))]
    if len(out) != count:
        raise StoreError(f"{folder}: feature store holds {len(out)} conversations, expected {count}; "
                         "delete it to rebuild")
    return out
