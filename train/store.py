"""The feature store: the verifier's last hidden states over the training conversations, computed once.

Online features cost a full verifier forward per token and per epoch, several times the head's own
step on a CPU; stored once, later epochs pay only the head. The store lives in
`<root>/<key>/` as safetensors shards (`features` [tokens, h] and `lengths` [examples]) plus a
meta.json. The key hashes everything the features depend on: the feature model's weights, the
tokenized examples (data source, selection, max length, chat template) and the stored dtype. A store
under another key is never read (it is removed, with a message); an interrupted build keeps the
shards it finished in `<key>.partial/` and continues from them. With several ranks, each builds every
world-th shard and rank 0 publishes the folder.

The cross-entropy target needs no storing: it is the verifier's distribution at the next position,
i.e. its LM head applied to the stored next feature, which training computes over the draft
vocabulary only (cheap).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from infra.cli import PolyspecError

SHARD_EXAMPLES = 64


class StoreError(PolyspecError, RuntimeError):
    """A feature store that cannot be used as it is; one-line message."""
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def store_key(feature_hash: str, sequences: list[torch.Tensor], dtype: str) -> str:
    digest = hashlib.sha256(f"{feature_hash}|{dtype}".encode())
    for ids in sequences:
        digest.update(ids.numpy().tobytes() + b"|")
    return digest.hexdigest()[:16]


@torch.inference_mode()
def _features(model: PreTrainedModel, sequences: list[torch.Tensor], batch: int) -> list[torch.Tensor]:
    """Last hidden states of each sequence; batched by similar length (right padding, causal: exact rows)."""
    base = getattr(model, model.base_model_prefix, model)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for start in range(0, len(order), batch):
        group = order[start:start + batch]
        width = max(len(sequences[i]) for i in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        attn = torch.zeros(len(group), width, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(sequences[i])], attn[row, :len(sequences[i])] = sequences[i], 1
        hidden = base(input_ids=ids.to(model.device), attention_mask=attn.to(model.device)).last_hidden_state.cpu()  # the store lives in host memory
        for row, i in enumerate(group):
            out[i] = hidden[row, :len(sequences[i])]
    return out  # type: ignore[return-value]


def build_or_load(model: PreTrainedModel, sequences: list[torch.Tensor], root: Path,
                  feature_hash: str, dtype: str, batch: int, rank: int = 0, world: int = 1) -> list[torch.Tensor]:  # rank/world: each rank computes its share of the store
    """Per-sequence features [len, h] in `dtype`, from the store under `root` (built first if missing)."""
    key = store_key(feature_hash, sequences, dtype)
    folder = root / key
    if not (folder / "meta.json").is_file():
        _build(model, sequences, root, key, STORE_DTYPES[dtype], batch, rank, world)
    elif rank == 0:
        print(f"feature store: reusing {folder}")
    return _load(folder, len(sequences))


def _build(model, sequences, root: Path, key: str, dtype: torch.dtype, batch: int, rank: int, world: int) -> None:  # rank/world: each rank computes its share of the store
    partial = root / f"{key}.partial"
    tokens, h = sum(len(s) for s in sequences), model.config.hidden_size
    shards = range(0, len(sequences), SHARD_EXAMPLES)
    if rank == 0:
        for stale in root.glob("*") if root.is_dir() else []:
            if stale.name not in (key, partial.name):
                print(f"feature store: removing {stale} (built for other weights, data or settings)")
                shutil.rmtree(stale, ignore_errors=True)
        print(f"feature store: {len(sequences):,} conversations, {tokens:,} tokens x {h} x {dtype} = "
              f"{tokens * h * dtype.itemsize / 2**20:,.1f} MiB in {root / key}")
    partial.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    mine = [s for n, s in enumerate(shards) if n % world == rank]
    bar = tqdm(total=sum(len(t) for s in mine for t in sequences[s:s + SHARD_EXAMPLES]), unit="tok",
               desc="feature store", disable=rank != 0, dynamic_ncols=True)
    for start in mine:
        part, shard = sequences[start:start + SHARD_EXAMPLES], partial / f"shard-{start // SHARD_EXAMPLES:05d}.safetensors"
        if not shard.is_file():  # shards finished by an interrupted build are kept
            feats = torch.cat(_features(model, part, batch)).to(dtype)
            tmp = shard.with_name(f".{shard.name}.tmp")
            save_file({"features": feats.contiguous(), "lengths": torch.tensor([len(s) for s in part])}, str(tmp))
            tmp.replace(shard)
        bar.update(sum(len(s) for s in part))
    bar.close()
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        seconds = time.perf_counter() - started  # all ranks' shards done (the barrier); shards kept from before included
        meta = {"key": key, "conversations": len(sequences), "tokens": tokens, "hidden_size": h,
                "dtype": str(dtype).removeprefix("torch."), "shard_examples": SHARD_EXAMPLES, "device": str(model.device),
                "build_seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
        print(f"feature store: built in {seconds:.1f} s on {model.device} ({tokens / max(seconds, 1e-9):,.0f} tokens/s)")
        (partial / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        partial.rename(root / key)
    if dist.is_initialized():
        dist.barrier()


def _load(folder: Path, count: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for shard in sorted(folder.glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        out += list(torch.split(tensors["features"], tensors["lengths"].tolist()))
    if len(out) != count:
        raise StoreError(f"{folder}: feature store holds {len(out)} conversations, expected {count}; delete it to rebuild")
    return out
