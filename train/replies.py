"""Training replies written by the verifier itself (`train.replies=verifier`): self-distillation data.

At run time the head drafts the verifier's own greedy text, but ShareGPT's replies were written by
another, much larger model: a 135M verifier phrases, repeats and ends differently, and the head learns
most from the text it will actually be asked to continue. Here each training conversation's first user
turn (with any system turn before it) is answered greedily by the feature model, in left-padded
batches, and the prompt plus that reply becomes the training example (loss on the reply).

Generating costs a verifier forward per new token (batched, so a fraction of AR decoding's), and is
done once: the replies are cached as JSON under `<root>/replies-<key>.json`, where the key hashes the
feature model's weights, the prompts and the generation settings. A cache under another key is never
read. With several ranks, each generates every world-th batch and the replies are all-gathered.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from infra.tracking import write_json_atomic
from train.distributed import Share
from train.store import FeatureSource


def replies_key(feature_hash: str, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> str:
    digest = hashlib.sha256(f"{feature_hash}|{max_new_tokens}|{eos}|greedy".encode())
    for ids in prompts:
        digest.update(json.dumps(ids).encode() + b"|")
    return digest.hexdigest()[:16]


@torch.inference_mode()
def greedy_with_features(model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]],
                         max_new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy reply, cut after its first EOS, with the model's last hidden states over prompt + reply
    (what the feature store holds, taken from the forwards that wrote the reply). One left-padded batch: a prefill,
    then a token a step; a row leaves the batch (its cache rows with it) once its last token has been fed."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    base, lm_head = getattr(model, model.base_model_prefix), model.get_output_embeddings()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    cache = DynamicCache(config=model.config)
    hidden = base(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache, use_cache=True).last_hidden_state
    features = [[hidden[i, width - len(p):]] for i, p in enumerate(prompts)]
    replies: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompts still in the batch, in its order
    while rows:
        tokens = lm_head(hidden[:, -1]).argmax(-1)
        for row, token in zip(rows, tokens.tolist()):
            replies[row].append(token)
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], 1)
        hidden = base(input_ids=tokens[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                      past_key_values=cache, use_cache=True).last_hidden_state
        for row, state in zip(rows, hidden):
            features[row].append(state)
        going = [j for j, row in enumerate(rows) if replies[row][-1] != eos and len(replies[row]) < max_new_tokens]
        if going and len(going) < len(rows):
            cache.batch_select_indices(torch.tensor(going, dtype=torch.long, device=model.device))
        attn, hidden, rows = attn[going], hidden[going], [rows[j] for j in going]
    return [(reply, torch.cat(parts)) for reply, parts in zip(replies, features)]


def greedy_replies(model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """The model's greedy continuation of each prompt of one batch, each cut after its first EOS."""
    return [reply for reply, _ in greedy_with_features(model, tokenizer, prompts, max_new_tokens)]


@dataclass(frozen=True)
class Replies:
    """The feature model's reply to each prompt, and where this process generated them all, the last hidden states
    over each prompt + reply (the feature store's; None when read from the cache or shared among ranks)."""

    tokens: list[list[int]]
    features: list[torch.Tensor] | None = None


def regenerate(source: FeatureSource, tokenizer: Any, prompts: list[list[int]], settings: Any, root: Path,
               share: Share = Share()) -> Replies:
    """The feature model's greedy reply to each prompt (token ids, up to `settings.max_new_tokens`, `settings.batch`
    prompts a forward), from the cache under `root` or generated, each rank generating its share."""
    model, max_new_tokens, batch = source.model, settings.max_new_tokens, settings.batch
    rank, world = share.rank, share.world
    key = replies_key(source.weights_hash, prompts, max_new_tokens, tokenizer.eos_token_id)
    path = root / f"replies-{key}.json"
    if path.is_file():
        if rank == 0:
            print(f"replies: reusing {path}")
        return Replies(json.loads(path.read_text())["replies"])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch: less padding
    batches = [order[s: s + batch] for s in range(0, len(order), batch)]
    mine, features = {}, {}
    for group in tqdm(batches[rank::world], desc=f"replies by the verifier (<= {max_new_tokens} tokens each)",
                      disable=rank != 0):
        written = greedy_with_features(model, tokenizer, [prompts[i] for i in group], max_new_tokens)
        for i, (reply, states) in zip(group, written):
            mine[i], features[i] = reply, states.cpu()
    if world > 1:
        parts: list[dict] = [{} for _ in range(world)]
        dist.all_gather_object(parts, mine)
        mine = {i: reply for part in parts for i, reply in part.items()}
    replies = [mine[i] for i in range(len(prompts))]
    if rank == 0:
        write_json_atomic(path, {"max_new_tokens": max_new_tokens, "prompts": len(prompts), "replies": replies})
        print(f"replies: {sum(map(len, replies)):,} tokens written to {path}")
    if world > 1:
        dist.barrier()
    return Replies(replies, [features[i] for i in range(len(prompts))] if world == 1 else None)
