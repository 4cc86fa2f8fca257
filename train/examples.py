"""Training examples: ShareGPT conversations tokenized and masked (or the feature model's own replies), the order
of the micro batches of every optimizer step (the same for any number of ranks), padding, the draft vocabulary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from data.sharegpt import chat_prompt_ids, load_split, tokenize_conversation, warn_truncated
from data.vocab import assistant_token_counts, coverage, top_tokens
from train import replies
from train.distributed import Share
from train.errors import TrainError
from train.settings import EagleTraining, TrainSettings
from train.store import FeatureSource


@dataclass(frozen=True)
class Example:
    id: str
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool: assistant tokens
    features: torch.Tensor | None = None  # [L, h]: the feature store's, where the verifier's replies brought them


def load_examples(settings: TrainSettings, tokenizer: Any, source: FeatureSource, share: Share = Share(),
                  split: tuple[list, list] | None = None) -> tuple[list[Example], list[list[int]]]:
    """Training conversations (tokenized, masked, capped; their replies the dataset's or, with
    `train.replies=verifier`, the feature model's own, each rank generating its share) and held-out chat prompts for
    evaluation. `split`: the conversations, when the caller read them before loading any model."""
    t = settings.train
    train, held_out = split or load_split(settings.data)
    caps = [c for c in (settings.data.max_conversations, t.max_conversations) if c]
    train = train[: min(caps)] if caps else train
    max_len = settings.token_cap
    if t.replies == "verifier":
        examples = verifier_examples(settings, train, tokenizer, source, share)
    else:
        tokenized = [tokenize_conversation(tokenizer, conv, max_len) for conv in train]
        warn_truncated(tokenized, max_len, "train.max_len")
        examples = [Example(tok.id, torch.tensor(tok.input_ids), torch.tensor(tok.loss_mask, dtype=torch.bool))
                    for tok in tokenized]
    examples = [e for e in examples if len(e.input_ids) >= 3 and e.loss_mask[2:].any()]
    if not examples:
        raise TrainError(f"{settings.data.source}: no training conversation with assistant tokens")
    prompts = []
    for conv in held_out:
        ids = first_turn_prompt(tokenizer, conv)
        if ids is not None and len(ids) <= t.eval.max_prompt_len:
            prompts.append(ids)
        if len(prompts) == t.eval.conversations:
            break
    return examples, prompts


def first_turn_prompt(tokenizer: Any, conv: Any) -> list[int] | None:
    """The chat prompt asking for a conversation's first assistant reply (None if it has none)."""
    first_reply = next((i for i, t in enumerate(conv.turns) if t.role == "assistant"), None)
    return None if first_reply is None else chat_prompt_ids(tokenizer, conv.messages()[:first_reply])


def verifier_examples(settings: TrainSettings, conversations: list[Any], tokenizer: Any, source: FeatureSource,
                      share: Share) -> list[Example]:
    """Each conversation's first user turn and the feature model's greedy reply to it (train/replies.py)."""
    max_len = settings.token_cap
    pairs = [(conv.id, ids) for conv in conversations
             if (ids := first_turn_prompt(tokenizer, conv)) is not None and len(ids) < max_len - 2]
    answers = replies.regenerate(source, tokenizer, [ids for _, ids in pairs], settings.train.regenerate,
                                 settings.run.layout.feature_store, share)
    examples = []
    for n, ((conv_id, prompt), reply) in enumerate(zip(pairs, answers.tokens)):
        reply = reply[: max_len - len(prompt)]
        features = None if answers.features is None else answers.features[n][: len(prompt) + len(reply)]
        examples.append(Example(conv_id, torch.tensor(prompt + reply),
                                torch.tensor([False] * len(prompt) + [True] * len(reply)), features))
    return examples


def sample_index(i: int, n: int, seed: int) -> int:
    """The i-th sample of the training stream: epoch after epoch, each a seeded permutation."""
    epoch, pos = divmod(i, n)
    return int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))[pos])


def step_micro_batches(step: int, n: int, t: EagleTraining, seed: int, rank: int,
                       world: int) -> list[tuple[int, list[int]]]:
    """This rank's micro batches of an optimizer step as (chunk id, example indices).

    The step's global batch is cut into world*accum chunks; chunk a*world + rank is this rank's a-th
    micro batch, so one process with accum=2 sees exactly the chunks two processes with accum=1 see.
    """
    per_step = t.micro_batch * t.grad_accum * world
    start = step * per_step
    chunks = []
    for a in range(t.grad_accum):
        chunk = a * world + rank
        first = start + chunk * t.micro_batch
        chunks.append((chunk, [sample_index(i, n, seed) for i in range(first, first + t.micro_batch)]))
    return chunks


def pad(examples: list[Example], stored: list[dict[str, torch.Tensor]],
        all_tokens: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded (input_ids, the stored tensors (train/store.py: floating ones in fp32), loss_mask) of a micro batch;
    padding is never a loss position. The loss mask is the examples' (assistant tokens) or, with `all_tokens`, every
    real position."""
    L = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), L, dtype=torch.long)
    loss = torch.zeros(len(examples), L, dtype=torch.bool)
    padded = {k: torch.zeros(len(examples), L, *v.shape[1:], dtype=torch.float32 if v.is_floating_point() else v.dtype)
              for k, v in stored[0].items()}
    for b, (e, s) in enumerate(zip(examples, stored)):
        n = len(e.input_ids)
        ids[b, :n], loss[b, :n] = e.input_ids, True if all_tokens else e.loss_mask
        for k, v in s.items():
            padded[k][b, :n] = v
    return ids, padded, loss


def draft_vocabulary(n: int | None, examples: list[Example], tokenizer: Any, vocab_size: int,
                     rank: int) -> torch.Tensor | None:
    """The head's draft vocabulary: the `n` (train.draft_vocab) most frequent assistant tokens (and EOS), or None
    (full)."""
    if not n or n >= vocab_size:
        return None
    counts = assistant_token_counts((e.input_ids.tolist(), e.loss_mask.tolist()) for e in examples)
    vocab = top_tokens(counts, int(n), vocab_size, always=[i for i in [tokenizer.eos_token_id] if i is not None])
    if rank == 0:
        print(f"draft vocabulary: {len(vocab):,} of {vocab_size:,} tokens, "
              f"covering {coverage(counts, vocab):.2%} of training reply tokens")
    return vocab
