"""Held-out evaluation of a head during and after training: the verifier's greedy continuations of held-out prompts,
then the head's chain drafts from the verifier's features (top-1 per depth, expected acceptance length)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import DynamicCache, PreTrainedModel

from heads.eagle import DraftHead, additive_mask
from train import replies
from train.errors import TrainError


@dataclass
class EvalSequence:
    ids: torch.Tensor       # [L]: held-out prompt + the verifier's own greedy continuation
    features: torch.Tensor  # [L, h]: the verifier's last hidden states (EAGLE-3: the aux states [L, 3h])
    greedy: torch.Tensor    # [L]: the verifier's argmax next token at each position
    prompt_len: int


@torch.no_grad()
def prepare_eval(model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]], gen_tokens: int, batch: int,
                 aux_layers: tuple[int, ...] = ()) -> list[EvalSequence]:
    """Held-out prompts continued greedily by the verifier: on such text, a chain draft is accepted
    exactly while the head's argmax equals the verifier's, so acceptance is measured, not approximated.
    The features are the ones the head drafts from: the last hidden states, or with `aux_layers` (EAGLE-3) the
    states entering those layers side by side."""
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i: i + batch]
        for p, row in zip(group, replies.greedy_replies(model, tokenizer, group, gen_tokens)):
            seq = torch.tensor([p + row], device=model.device)
            result = getattr(model, model.base_model_prefix)(input_ids=seq, output_hidden_states=bool(aux_layers))
            greedy = model.get_output_embeddings()(result.last_hidden_state).argmax(-1)
            features = (torch.cat([result.hidden_states[i] for i in aux_layers], -1) if aux_layers
                        else result.last_hidden_state)
            out.append(EvalSequence(seq[0], features[0], greedy[0], len(p)))
    return out


def unroll(head: Any, ids: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Predicted features [B, n, h] of the depth 1..`depth` drafts from every start s < n = L - 1 - depth.

    Start s: the head has the verifier's features up to position s and the accepted token s+1; depth
    j feeds back its own predicted feature and the token at s+j (which an accepted draft equals).
    One head call per depth drafts all starts at once: a tree mask lets each start's query see the
    verifier's features up to s and its own earlier depths only, which is what decoding computes.
    Used by the held-out evaluation and by training on the head's own features (train.unroll).
    """
    B, L = ids.shape
    n = L - 1 - depth
    dtype = (head.module if hasattr(head, "module") else head).fc.weight.dtype
    cache = DynamicCache()
    hidden, _, _ = head(ids[:, 1:n + 1], features[:, :n], cache, compute_logits=False)
    hiddens, s = [hidden], torch.arange(n, device=ids.device)
    for j in range(2, depth + 1):
        past = cache.get_seq_length()
        allowed = torch.zeros(n, past + n, dtype=torch.bool, device=ids.device)
        allowed[:, :n] = s[None, :] <= s[:, None]
        for d in range(2, j + 1):  # this start's own drafts at depths 2..j, each depth n keys wide
            allowed[s, (d - 1) * n + s] = True
        hidden, _, _ = head(ids[:, j:n + j], hidden, cache, position_ids=(s + j - 1)[None].expand(B, n),
                            attention_mask=additive_mask(allowed, dtype)[None, None], compute_logits=False)
        hiddens.append(hidden)
    return hiddens


@torch.no_grad()
def chain_drafts(head: DraftHead, ids: torch.Tensor, features: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth-`depth` chain drafts (target token ids) from every start of a sequence: [depth, n],
    n = len(ids) - 1 - depth."""
    return torch.stack([head.token_ids(head.logits(h[0]).argmax(-1))
                        for h in unroll(head, ids[None], features[None], depth)])


@torch.no_grad()
def evaluate_head(head: DraftHead, sequences: list[EvalSequence], depth: int) -> dict[str, float]:
    """Top-1 at depth 1..k of autoregressive drafting from the head's own features, and the expected
    acceptance length (accepted drafts + the verifier's bonus token) of a depth-k chain draft, over
    every start in the verifier-generated text. The draft at depth j is accepted iff it and all
    shallower ones equal the verifier's greedy tokens (greedy verification)."""
    head.eval()
    hits_per_depth = torch.zeros(depth)
    accepted, starts = [], 0
    for seq in sequences:
        n = len(seq.ids) - 1 - depth
        if n <= 0:
            continue
        drafts = chain_drafts(head, seq.ids, seq.features, depth)
        hits = torch.stack([drafts[j - 1] == seq.greedy[j: n + j] for j in range(1, depth + 1)]).cpu()  # [depth, n]
        hits = hits[:, torch.arange(n) >= seq.prompt_len - 2]  # drafts of generated tokens only
        hits_per_depth += hits.float().sum(1)
        accepted.append(hits.int().cumprod(0).sum(0))
        starts += hits.shape[1]
    if not starts:
        raise TrainError("held-out evaluation: no usable held-out sequence "
                         "(raise train.eval.gen_tokens or conversations)")
    accepted = torch.cat(accepted).float()
    metrics = {f"top1_depth{j}": (hits_per_depth[j - 1] / starts).item() for j in range(1, depth + 1)}
    metrics[f"acceptance_length_depth{depth}"] = 1.0 + accepted.mean().item()
    metrics["eval_starts"] = starts
    return metrics


def evaluate_on_rank0(head: DraftHead, sequences: list[EvalSequence], depth: int, rank: int) -> dict[str, float]:
    """Rank 0 evaluates with the full weights (gathered under ZeRO-3, a no-op otherwise); others wait."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        metrics = evaluate_head(head, sequences, depth) if rank == 0 else {}
    dist.barrier()
    return metrics
