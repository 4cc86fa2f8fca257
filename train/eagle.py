"""`python -m train.eagle`: train the EAGLE-2 draft head against its verifier's hidden states (DeepSpeed).

Features are the verifier's last hidden states (the target's, or the W4 model's with
`train.feature_source=w4`, since in the polybasic chain the head drafts for M2), computed once into a
feature store (train/store.py) so that epochs cost only the head's own forward and backward. Loss on
assistant tokens: SmoothL1 on the next feature + weighted cross-entropy against the verifier's
next-token distribution over the head's draft vocabulary (`train.draft_vocab` most frequent reply
tokens), with uniform noise on the input features. Held-out evaluations during training form a
learning curve (metrics.json, W&B, learning_curve.png in the head folder).

Always runs through `deepspeed.initialize`: plain `python -m train.eagle` is a one-process gloo group;
`torchrun --nproc_per_node=2 -m train.eagle` is data-parallel (each optimizer step's global batch is
split across ranks, so the result does not depend on how many processes share it).
"""
from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from data.artifacts import Artifacts
from data.models import load_model, same_vocabulary, weights_hash
from data.cli import Interrupted, PolyspecError, flag, run_main
from data.sharegpt import (chat_prompt_ids, load_conversations, split_conversations, tokenize_conversation,
                           warn_truncated)
from data.tracking import Tracker
from data.vocab import assistant_token_counts, coverage, top_tokens
from decode.head import FORMAT_VERSION, EagleHead, additive_mask
from train import replies, store

FEATURE_SOURCES = ("target", "w4")
REPLIES = ("dataset", "verifier")
LOSS_TOKENS = ("replies", "all")
PRECISIONS = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2, 3)
INITS = ("random", "target_last_layer")


class TrainError(PolyspecError, RuntimeError):
    """A bad training config or state; the message is one line, meant for the user."""


class TrainingInterrupted(Interrupted):
    """Ctrl-C (or SIGTERM) stopped training after a checkpoint was written."""


# ---------------------------------------------------------------- config and setup

def validate(cfg: DictConfig) -> None:
    t = cfg.train
    for key in RUN_CONTROL_KEYS:  # strictly boolean: the string 'false' would be truthy
        flag(t, key, error=TrainError)
    if t.feature_source not in FEATURE_SOURCES:
        raise TrainError(f"train.feature_source={t.feature_source!r}: must be one of {', '.join(FEATURE_SOURCES)}")
    if t.zero_stage not in ZERO_STAGES:
        raise TrainError(f"train.zero_stage={t.zero_stage}: DeepSpeed ZeRO stage must be one of 0, 1, 2, 3")
    if t.precision not in PRECISIONS:
        raise TrainError(f"train.precision={t.precision!r}: must be one of {', '.join(PRECISIONS)}")
    if t.store_dtype not in store.STORE_DTYPES:
        raise TrainError(f"train.store_dtype={t.store_dtype!r}: must be one of {', '.join(store.STORE_DTYPES)}")
    if t.replies not in REPLIES:
        raise TrainError(f"train.replies={t.replies!r}: must be one of {', '.join(REPLIES)}")
    if t.loss_tokens not in LOSS_TOKENS:
        raise TrainError(f"train.loss_tokens={t.loss_tokens!r}: must be one of {', '.join(LOSS_TOKENS)}")
    if t.init not in INITS:
        raise TrainError(f"train.init={t.init!r}: must be one of {', '.join(INITS)}")
    if t.draft_vocab is not None and (not isinstance(t.draft_vocab, int) or t.draft_vocab < 1):
        raise TrainError(f"train.draft_vocab={t.draft_vocab!r}: must be a positive integer (or null for the full vocabulary)")
    for key in ("micro_batch", "grad_accum", "epochs", "max_len", "checkpoint_every", "store_batch", "unroll"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise TrainError(f"train.{key}={t[key]!r}: must be a positive integer")
    for group, key in (("eval", "depth"), ("eval", "batch"), ("regenerate", "max_new_tokens"), ("regenerate", "batch")):
        if not isinstance(t[group][key], int) or t[group][key] < 1:
            raise TrainError(f"train.{group}.{key}={t[group][key]!r}: must be a positive integer")


def init_distributed() -> tuple[int, int]:
    """(rank, world size): torchrun's environment, or a one-process gloo group set up here."""
    import deepspeed

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return dist.get_rank(), dist.get_world_size()


def load_verifiers(cfg: DictConfig) -> tuple[PreTrainedModel, Any, PreTrainedModel]:
    """(target, its tokenizer, the feature model): the target itself or the W4 model in quantize.output."""
    target, tokenizer = load_model(cfg.model.name, cfg.model.dtype)
    if cfg.train.feature_source == "target":
        return target, tokenizer, target
    w4_path = Artifacts.of(cfg).output("w4")
    if not (w4_path / "config.json").is_file():
        raise TrainError(f"{w4_path}: no W4 model there (run `python -m quantize.w4` first, or use train.feature_source=target)")
    w4, w4_tokenizer = load_model(str(w4_path), cfg.model.dtype)
    if not same_vocabulary(tokenizer, w4_tokenizer) or w4.config.hidden_size != target.config.hidden_size:
        raise TrainError(f"{w4_path}: the W4 model's vocabulary or hidden size differs from the target {cfg.model.name}")
    return target, tokenizer, w4


# ---------------------------------------------------------------- data

@dataclass(frozen=True)
class Example:
    id: str
    input_ids: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] bool: assistant tokens


def load_examples(cfg: DictConfig, tokenizer: Any, feature_model: PreTrainedModel, feature_hash: str,
                  rank: int = 0, world: int = 1) -> tuple[list[Example], list[list[int]]]:
    """Training conversations (tokenized, masked, capped; their replies the dataset's or, with
    `train.replies=verifier`, the feature model's own) and held-out chat prompts for evaluation."""
    train, held_out = split_conversations(load_conversations(cfg.data.source), cfg.data.held_out_fraction)
    caps = [c for c in (cfg.data.get("max_conversations"), cfg.train.max_conversations) if c]
    train = train[: min(caps)] if caps else train
    max_len = min(cfg.data.max_len, cfg.train.max_len)
    if cfg.train.replies == "verifier":
        examples = verifier_examples(cfg, train, tokenizer, feature_model, feature_hash, max_len, rank, world)
    else:
        tokenized = [tokenize_conversation(tokenizer, conv, max_len) for conv in train]
        warn_truncated(tokenized, max_len, "train.max_len")
        examples = [Example(tok.id, torch.tensor(tok.input_ids), torch.tensor(tok.loss_mask, dtype=torch.bool))
                    for tok in tokenized]
    examples = [e for e in examples if len(e.input_ids) >= 3 and e.loss_mask[2:].any()]
    if not examples:
        raise TrainError(f"{cfg.data.source}: no training conversation with assistant tokens")
    prompts = []
    for conv in held_out:
        ids = first_turn_prompt(tokenizer, conv)
        if ids is not None and len(ids) <= cfg.train.eval.max_prompt_len:
            prompts.append(ids)
        if len(prompts) == cfg.train.eval.conversations:
            break
    return examples, prompts


def first_turn_prompt(tokenizer: Any, conv: Any) -> list[int] | None:
    """The chat prompt asking for a conversation's first assistant reply (None if it has none)."""
    first_reply = next((i for i, t in enumerate(conv.turns) if t.role == "assistant"), None)
    return None if first_reply is None else chat_prompt_ids(tokenizer, conv.messages()[:first_reply])


def verifier_examples(cfg: DictConfig, conversations: list[Any], tokenizer: Any, model: PreTrainedModel, feature_hash: str,
                      max_len: int, rank: int, world: int) -> list[Example]:
    """Each conversation's first user turn and the feature model's greedy reply to it (train/replies.py)."""
    r = cfg.train.regenerate
    pairs = [(conv.id, ids) for conv in conversations
             if (ids := first_turn_prompt(tokenizer, conv)) is not None and len(ids) < max_len - 2]
    answers = replies.regenerate(model, tokenizer, [ids for _, ids in pairs], r.max_new_tokens, r.batch,
                                 Path(cfg.run_dir) / "eagle_features", feature_hash, rank, world)
    examples = []
    for (conv_id, prompt), reply in zip(pairs, answers):
        reply = reply[: max_len - len(prompt)]
        examples.append(Example(conv_id, torch.tensor(prompt + reply),
                                torch.tensor([False] * len(prompt) + [True] * len(reply))))
    return examples


def sample_index(i: int, n: int, seed: int) -> int:
    """The i-th sample of the training stream: epoch after epoch, each a seeded permutation."""
    epoch, pos = divmod(i, n)
    return int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))[pos])


def step_micro_batches(step: int, n: int, t: DictConfig, seed: int, rank: int, world: int) -> list[tuple[int, list[int]]]:
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


def pad(examples: list[Example], features: list[torch.Tensor], all_tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, features in fp32, loss_mask) of a micro batch; padding is never a loss position.
    The loss mask is the examples' (assistant tokens) or, with `all_tokens`, every real position."""
    L, h = max(len(e.input_ids) for e in examples), features[0].shape[-1]
    ids = torch.zeros(len(examples), L, dtype=torch.long)
    feats = torch.zeros(len(examples), L, h)
    loss = torch.zeros(len(examples), L, dtype=torch.bool)
    for b, (e, f) in enumerate(zip(examples, features)):
        n = len(e.input_ids)
        ids[b, :n], feats[b, :n], loss[b, :n] = e.input_ids, f, True if all_tokens else e.loss_mask
    return ids, feats, loss


# ---------------------------------------------------------------- loss

def micro_batch_loss(head: Any, feats: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                     t: DictConfig, noise_seed: int) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE loss of one micro batch: (f_s + noise, x_{s+1}) -> f_{s+1} and p(x_{s+2}), assistant tokens only;
    with `train.unroll` = k > 1 also depths 2..k drafted from the head's own predicted features (EAGLE-3's
    training-time test), each depth's loss weighted equally.

    The cross-entropy target is the verifier's distribution at the predicted position, its LM head on the
    stored feature, over the head's draft vocabulary (renormalised there); the head's logits cover the same
    tokens."""
    module = head.module if hasattr(head, "module") else head
    depth = t.unroll
    n = ids.shape[1] - 1 - depth
    noise = (torch.rand(feats[:, :n].shape, generator=torch.Generator().manual_seed(noise_seed)) - 0.5) * t.noise
    loss, stats = torch.zeros(()), {"feature_loss": 0.0, "ce": 0.0}
    for j, hidden in enumerate(unroll(head, ids, feats[:, :n] + noise, depth), start=1):
        mask = loss_mask[:, j + 1:n + j + 1]
        hidden, feat_target = hidden[mask].float(), feats[:, j:n + j][mask].float()
        logits = module.logits(hidden)
        with torch.no_grad():
            target_probs = torch.softmax(module.logits(feat_target).float(), dim=-1)
        feature_loss = F.smooth_l1_loss(hidden, feat_target)
        ce = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
        loss = loss + (t.feature_weight * feature_loss + t.ce_weight * ce) / depth
        stats["feature_loss"] += feature_loss.item() / depth
        stats["ce"] += ce.item() / depth
        if j == 1:
            stats["correct"] = (logits.argmax(-1) == target_probs.argmax(-1)).sum().item()
            stats["predicted"] = int(mask.sum())
    return loss, {"loss": loss.item(), **stats}


def lr_multiplier(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------- evaluation

@dataclass
class EvalSequence:
    ids: torch.Tensor       # [L]: held-out prompt + the verifier's own greedy continuation
    features: torch.Tensor  # [L, h]: the verifier's last hidden states
    greedy: torch.Tensor    # [L]: the verifier's argmax next token at each position
    prompt_len: int


@torch.no_grad()
def prepare_eval(model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]], gen_tokens: int, batch: int) -> list[EvalSequence]:
    """Held-out prompts continued greedily by the verifier: on such text, a chain draft is accepted
    exactly while the head's argmax equals the verifier's, so acceptance is measured, not approximated."""
    out = []
    for i in range(0, len(prompts), batch):
        group = prompts[i: i + batch]
        for p, row in zip(group, replies.greedy_replies(model, tokenizer, group, gen_tokens)):
            seq = torch.tensor([p + row])
            features = getattr(model, model.base_model_prefix)(input_ids=seq).last_hidden_state
            greedy = model.get_output_embeddings()(features).argmax(-1)
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
    hiddens, s = [hidden], torch.arange(n)
    for j in range(2, depth + 1):
        past = cache.get_seq_length()
        allowed = torch.zeros(n, past + n, dtype=torch.bool)
        allowed[:, :n] = s[None, :] <= s[:, None]
        for d in range(2, j + 1):  # this start's own drafts at depths 2..j, each depth n keys wide
            allowed[s, (d - 1) * n + s] = True
        hidden, _, _ = head(ids[:, j:n + j], hidden, cache, position_ids=(s + j - 1)[None].expand(B, n),
                            attention_mask=additive_mask(allowed, dtype)[None, None], compute_logits=False)
        hiddens.append(hidden)
    return hiddens


@torch.no_grad()
def chain_drafts(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth-`depth` chain drafts (target token ids) from every start of a sequence: [depth, n], n = len(ids) - 1 - depth."""
    return torch.stack([head.token_ids(head.logits(h[0]).argmax(-1)) for h in unroll(head, ids[None], features[None], depth)])


@torch.no_grad()
def evaluate(head: EagleHead, sequences: list[EvalSequence], depth: int) -> dict[str, float]:
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
        hits = torch.stack([drafts[j - 1] == seq.greedy[j: n + j] for j in range(1, depth + 1)])  # [depth, n]
        hits = hits[:, torch.arange(n) >= seq.prompt_len - 2]  # drafts of generated tokens only
        hits_per_depth += hits.float().sum(1)
        accepted.append(hits.int().cumprod(0).sum(0))
        starts += hits.shape[1]
    if not starts:
        raise TrainError("held-out evaluation: no usable held-out sequence (raise train.eval.gen_tokens or conversations)")
    accepted = torch.cat(accepted).float()
    metrics = {f"top1_depth{j}": (hits_per_depth[j - 1] / starts).item() for j in range(1, depth + 1)}
    metrics[f"acceptance_length_depth{depth}"] = 1.0 + accepted.mean().item()
    metrics["eval_starts"] = starts
    return metrics


def evaluate_on_rank0(head: EagleHead, sequences: list[EvalSequence], depth: int, rank: int) -> dict[str, float]:
    """Rank 0 evaluates with the full weights (gathered under ZeRO-3, a no-op otherwise); others wait."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        metrics = evaluate(head, sequences, depth) if rank == 0 else {}
    dist.barrier()
    return metrics


# ---------------------------------------------------------------- checkpoints

def checkpoint_fingerprint(cfg: DictConfig, world: int) -> dict[str, Any]:
    """What must not change between a checkpoint and its resumption (else the data order or schedule differ)."""
    t = cfg.train
    keys = ("feature_source", "max_conversations", "max_len", "epochs", "max_steps", "lr", "warmup_steps", "min_lr_ratio",
            "draft_vocab", "init", "store_dtype", "unroll")
    return {**{k: t[k] for k in keys}, "global_batch": t.micro_batch * t.grad_accum * world, "seed": cfg.seed,
            "data_source": cfg.data.source, "model": cfg.model.name}


def save_checkpoint(engine: Any, ckpt_dir: Path, step: int, client_state: dict, keep: int, rank: int) -> None:
    """DeepSpeed checkpoint of step `step`; `latest` moves to it only once every rank has written."""
    tag = f"step{step:07d}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if rank == 0:
        tmp = ckpt_dir / ".latest.tmp"
        tmp.write_text(tag)
        tmp.replace(ckpt_dir / "latest")
        for old in sorted(p for p in ckpt_dir.glob("step*") if p.name != tag)[:-keep + 1 or None]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


class StopFlag:
    """First Ctrl-C/SIGTERM asks for a checkpoint-and-stop at the next step boundary; a second one kills."""

    def __init__(self):
        self.requested = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signum, self._previous[signum])

    def agreed(self) -> bool:
        """Every rank stops at the same step: any rank's request stops all."""
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- training

def deepspeed_config(t: DictConfig) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


RUN_CONTROL_KEYS = ("resume", "skip_if_valid")  # how a run is driven, not what it trains


def head_is_current(cfg: DictConfig, target_hash: str) -> bool:
    """True when train.output holds a finished head for this target and this training config."""
    out_dir = Artifacts.of(cfg).output("eagle")
    try:
        saved = json.loads((out_dir / "config.json").read_text()).get("polyspec", {})
        json.loads((out_dir / "metrics.json").read_text())
    except (OSError, ValueError, AttributeError):
        return False
    wanted = {**OmegaConf.to_container(cfg.train, resolve=True), "seed": cfg.seed,
              "data": OmegaConf.to_container(cfg.data, resolve=True)}
    trained = saved.get("training", {})
    same = all(trained.get(k) == v for k, v in wanted.items() if k not in (*RUN_CONTROL_KEYS, "output"))  # where, not what
    return same and saved.get("format_version") == FORMAT_VERSION and saved.get("target", {}).get("weights_hash") == target_hash


@dataclass
class Progress:
    """Where training stands: saved in every checkpoint, so a resumed run continues the same curve."""

    step: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)  # held-out evaluations against tokens seen
    last: dict[str, float] = field(default_factory=dict)  # the last step's training metrics


def draft_vocabulary(cfg: DictConfig, examples: list[Example], tokenizer: Any, vocab_size: int, rank: int) -> torch.Tensor | None:
    """The head's draft vocabulary: the `train.draft_vocab` most frequent assistant tokens (and EOS), or None (full)."""
    n = cfg.train.draft_vocab
    if not n or n >= vocab_size:
        return None
    counts = assistant_token_counts((e.input_ids.tolist(), e.loss_mask.tolist()) for e in examples)
    vocab = top_tokens(counts, int(n), vocab_size, always=[i for i in [tokenizer.eos_token_id] if i is not None])
    if rank == 0:
        print(f"draft vocabulary: {len(vocab):,} of {vocab_size:,} tokens, covering {coverage(counts, vocab):.2%} of training reply tokens")
    return vocab


def new_head(cfg: DictConfig, target: PreTrainedModel, vocab: torch.Tensor | None) -> EagleHead:
    """A fresh head: random (EAGLE's init) or `train.init=target_last_layer`: the decoder layer copied from
    the target's last layer and fc passing the feature half through unchanged."""
    head = EagleHead(target, draft_vocab=vocab)
    if cfg.train.init == "target_last_layer":
        last = getattr(target, target.base_model_prefix).layers[-1].state_dict()
        head.layer.load_state_dict({k: v for k, v in last.items() if not k.startswith("input_layernorm.")})
        h = head.config.hidden_size
        with torch.no_grad():
            head.fc.weight[:, h:].copy_(torch.eye(h))
    return head


CHECKPOINT_TAG = re.compile(r"step\d{7}")


def weights_only_loading(engine: Any) -> None:
    """Make DeepSpeed read checkpoints with `torch.load(weights_only=True)`: tensors, containers and the three
    DeepSpeed classes its ZeRO optimizer state holds, never arbitrary pickled objects (no code runs on load)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    def load(path: str, map_location: Any = None) -> Any:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine.load = load


def resume_progress(engine: Any, cfg: DictConfig, world: int, total_steps: int, rank: int) -> Progress:
    """The progress of the last checkpoint (train.resume=true and one exists), else a fresh start. Only
    this stage's own checkpoint folders (stepNNNNNNN inside the checkpoint folder) are read, weights-only."""
    ckpt_dir = Path(cfg.run_dir) / "eagle_checkpoints"
    if not cfg.train.resume or not (ckpt_dir / "latest").is_file():
        if cfg.train.resume and rank == 0:
            print(f"train.resume=true but no checkpoint in {ckpt_dir}; starting at step 0")
        return Progress()
    tag = (ckpt_dir / "latest").read_text().strip()
    if not CHECKPOINT_TAG.fullmatch(tag) or (ckpt_dir / tag).is_symlink() or not (ckpt_dir / tag).is_dir():
        raise TrainError(f"{ckpt_dir / 'latest'}: names {tag[:40]!r}, not a checkpoint of this stage (stepNNNNNNN inside {ckpt_dir})")
    weights_only_loading(engine)
    try:
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    except (pickle.UnpicklingError, RuntimeError, OSError, KeyError) as err:
        raise TrainError(f"{ckpt_dir / tag}: unreadable checkpoint ({err.__class__.__name__}: {str(err).splitlines()[0][:200]})") from None
    if client is None:
        raise TrainError(f"{ckpt_dir / tag}: unreadable checkpoint")
    fingerprint = checkpoint_fingerprint(cfg, world)
    if client["fingerprint"] != fingerprint:
        changed = sorted(k for k in fingerprint if client["fingerprint"].get(k) != fingerprint[k])
        raise TrainError(f"{ckpt_dir / tag}: written with a different training setup ({', '.join(changed)} changed); resume needs the same")
    if rank == 0:
        print(f"resumed from {ckpt_dir / tag} at step {client['progress']['step']}/{total_steps}")
    return Progress(**client["progress"])


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the stage; returns the final metrics (also in train.output/metrics.json)."""
    validate(cfg)
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    rank, world = init_distributed()
    t = cfg.train
    torch.manual_seed(cfg.seed)
    target, tokenizer, feature_model = load_verifiers(cfg)
    target_hash = weights_hash(target)
    if t.skip_if_valid and head_is_current(cfg, target_hash):
        if rank == 0:
            print(f"EAGLE head in {Artifacts.of(cfg).output('eagle')} is up to date (same target and training config); skipping")
        return json.loads((Artifacts.of(cfg).output("eagle") / "metrics.json").read_text())
    feature_hash = target_hash if feature_model is target else weights_hash(feature_model)
    examples, prompts = load_examples(cfg, tokenizer, feature_model, feature_hash, rank, world)
    per_step = t.micro_batch * t.grad_accum * world
    total_steps = t.max_steps or (t.epochs * len(examples)) // per_step
    if total_steps < 1:
        raise TrainError(f"{len(examples)} training conversations cannot fill one step of {per_step} (micro_batch x grad_accum x ranks)")
    features = store.build_or_load(feature_model, [e.input_ids for e in examples],
                                   Path(cfg.run_dir) / "eagle_features", feature_hash, t.store_dtype, t.store_batch, rank, world)
    head = new_head(cfg, target, draft_vocabulary(cfg, examples, tokenizer, target.config.vocab_size, rank))
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total_steps, t.warmup_steps, t.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(t))
    progress = resume_progress(engine, cfg, world, total_steps, rank)

    tracker = Tracker(cfg, "train.eagle") if rank == 0 else None
    eval_sequences = []
    if rank == 0:
        print(f"train.eagle: {len(examples)} conversations, {total_steps} steps of {per_step} "
              f"(micro {t.micro_batch} x accum {t.grad_accum} x {world} ranks), features from {t.feature_source}")
        eval_sequences = prepare_eval(feature_model, tokenizer, prompts, t.eval.gen_tokens, t.eval.batch)
    if not progress.curve:
        progress.curve.append(curve_point(progress, evaluate_on_rank0(head, eval_sequences, t.eval.depth, rank)))
        if rank == 0:
            print(f"untrained head: held-out acceptance length {progress.curve[0]['acceptance_length']:.3f}")
    run_steps(cfg, engine, scheduler, examples, features, eval_sequences, progress, total_steps, rank, world, tracker)
    metrics: dict[str, Any] = {}
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        if rank == 0:
            metrics = finish(cfg, head, eval_sequences, progress, len(examples), world,
                             {"target": target_hash, "features": feature_hash}, tokenizer, total_steps, tracker)
    dist.barrier()
    return metrics


def curve_point(progress: Progress, evaluation: dict[str, float]) -> dict[str, float]:
    """One point of the learning curve: held-out top-1 per depth and acceptance length at `tokens_seen`."""
    if not evaluation:  # ranks other than 0 do not evaluate
        return {}
    length = next(v for k, v in evaluation.items() if k.startswith("acceptance_length_depth"))
    return {"step": progress.step, "tokens_seen": progress.tokens_seen, "acceptance_length": length,
            **{k: v for k, v in evaluation.items() if k.startswith("top1_depth")}}


def run_steps(cfg: DictConfig, engine: Any, scheduler: Any, examples: list[Example], features: list[torch.Tensor],
              eval_sequences: list[EvalSequence], progress: Progress, total_steps: int, rank: int, world: int,
              tracker: Tracker | None) -> None:
    """The optimizer steps from `progress.step` to `total_steps`: evaluation, checkpoints, Ctrl-C."""
    t = cfg.train
    ckpt_dir, fingerprint = Path(cfg.run_dir) / "eagle_checkpoints", checkpoint_fingerprint(cfg, world)
    stop = StopFlag()
    bar = tqdm(total=total_steps, initial=progress.step, desc="eagle", disable=rank != 0, dynamic_ncols=True)
    try:
        while progress.step < total_steps:
            started = time.perf_counter()
            sums = optimizer_step(cfg, engine, examples, features, progress.step, rank, world)
            elapsed = time.perf_counter() - started
            progress.step += 1
            progress.train_seconds += elapsed
            progress.tokens_seen += int(sums["tokens"])
            micro_batches = t.grad_accum * world
            progress.last = {"train/loss": sums["loss"] / micro_batches, "train/feature_loss": sums["feature_loss"] / micro_batches,
                             "train/ce": sums["ce"] / micro_batches, "train/top1": sums["correct"] / max(1, sums["predicted"]),
                             "train/lr": scheduler.get_last_lr()[0], "train/tokens_per_s": sums["tokens"] / elapsed}
            bar.set_postfix(loss=f"{progress.last['train/loss']:.3f}", top1=f"{progress.last['train/top1']:.3f}",
                            tok_s=f"{progress.tokens_seen / progress.train_seconds:.0f}")
            bar.update()
            if rank == 0:
                tracker.log(progress.last, step=progress.step)
            if t.eval_every and progress.step % t.eval_every == 0 and progress.step < total_steps:
                point = curve_point(progress, evaluate_on_rank0(engine.module, eval_sequences, t.eval.depth, rank))
                if rank == 0:
                    progress.curve.append(point)
                    tracker.log({f"eval/{k}": v for k, v in point.items() if k != "step"}, step=progress.step)
                    tqdm.write(f"step {progress.step}: held-out acceptance length {point['acceptance_length']:.3f}, "
                               f"top-1@1 {point['top1_depth1']:.3f}")
            client = {"progress": asdict(progress), "fingerprint": fingerprint}
            if stop.agreed():
                save_checkpoint(engine, ckpt_dir, progress.step, client, t.keep_checkpoints, rank)
                raise TrainingInterrupted(f"interrupted at step {progress.step}/{total_steps}; checkpoint in {ckpt_dir}; continue with train.resume=true")
            if progress.step % t.checkpoint_every == 0 or progress.step == total_steps:
                save_checkpoint(engine, ckpt_dir, progress.step, client, t.keep_checkpoints, rank)
    finally:
        bar.close()
        stop.restore()
        if tracker is not None and progress.step < total_steps:
            tracker.finish()


def optimizer_step(cfg: DictConfig, engine: Any, examples: list[Example], features: list[torch.Tensor],
                   step: int, rank: int, world: int) -> dict[str, float]:
    """One optimizer step over this rank's micro batches; the sums of their statistics over all ranks."""
    engine.train()
    sums = {"loss": 0.0, "feature_loss": 0.0, "ce": 0.0, "correct": 0, "predicted": 0, "tokens": 0}
    for chunk, indices in step_micro_batches(step, len(examples), cfg.train, cfg.seed, rank, world):
        ids, feats, loss_mask = pad([examples[i] for i in indices], [features[i] for i in indices],
                                    all_tokens=cfg.train.loss_tokens == "all")
        loss, stats = micro_batch_loss(engine, feats, ids, loss_mask, cfg.train,
                                       noise_seed=cfg.seed * 1_000_003 + step * 1_009 + chunk)
        engine.backward(loss)
        engine.step()
        stats["tokens"] = sum(len(examples[i].input_ids) for i in indices)
        for k in sums:
            sums[k] += stats[k]
    totals = torch.tensor([sums[k] for k in sums], dtype=torch.float64)
    dist.all_reduce(totals)
    return dict(zip(sums, totals.tolist()))


def learning_curve_png(curve: list[dict[str, float]], depth: int) -> bytes:
    """Held-out top-1 per depth and acceptance length against tokens seen, as PNG bytes."""
    import io

    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [p["tokens_seen"] for p in curve]
    fig, (top1, length) = plt.subplots(1, 2, figsize=(10, 4))
    for j in range(1, depth + 1):
        top1.plot(tokens, [p[f"top1_depth{j}"] for p in curve], marker="o", label=f"depth {j}")
    top1.set(xlabel="training tokens seen", ylabel="held-out top-1", title="draft top-1 per depth")
    top1.legend()
    length.plot(tokens, [p["acceptance_length"] for p in curve], marker="o")
    length.set(xlabel="training tokens seen", ylabel="tokens per verification",
               title=f"expected acceptance length, depth-{depth} chain")
    for ax in (top1, length):
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def finish(cfg: DictConfig, head: EagleHead, eval_sequences: list[EvalSequence], progress: Progress, conversations: int,
           world: int, hashes: dict[str, str], tokenizer: Any, total_steps: int, tracker: Tracker) -> dict[str, Any]:
    """Final held-out evaluation, the head folder (atomic) and the W&B summary/artifact; rank 0 only."""
    t, k = cfg.train, cfg.train.eval.depth
    final = evaluate(head, eval_sequences, k)
    if progress.curve[-1]["step"] != progress.step:
        progress.curve.append(curve_point(progress, final))
    untrained = progress.curve[0]
    metrics = {**{f"eval/{m}": v for m, v in final.items()}, **progress.last,
               f"untrained/acceptance_length_depth{k}": untrained["acceptance_length"],
               "untrained/top1_depth1": untrained["top1_depth1"],
               "train/steps": progress.step, "train/seconds": progress.train_seconds, "train/tokens_seen": progress.tokens_seen,
               "train/tokens_per_s": progress.tokens_seen / max(progress.train_seconds, 1e-9),
               "train/conversations": conversations, "train/world_size": world,
               "draft_vocab": None if head.draft_vocab is None else len(head.draft_vocab), "curve": progress.curve}
    print(f"held-out acceptance length at depth {k}: {final[f'acceptance_length_depth{k}']:.3f} "
          f"(untrained head: {untrained['acceptance_length']:.3f}); "
          + ", ".join(f"top-1@{j} {final[f'top1_depth{j}']:.3f}" for j in range(1, k + 1)))
    training = {**OmegaConf.to_container(t, resolve=True), "seed": cfg.seed, "world_size": world,
                "data": OmegaConf.to_container(cfg.data, resolve=True), "feature_model_hash": hashes["features"],
                "total_steps": total_steps}
    out_dir = Artifacts.of(cfg).output("eagle")
    head.save_pretrained(out_dir, target_hash=hashes["target"], tokenizer=tokenizer, feature_source=t.feature_source,
                         training=training, metrics=metrics,
                         files={"learning_curve.png": learning_curve_png(progress.curve, k)})
    tracker.summary({key: v for key, v in metrics.items() if key != "curve"})
    tracker.log_artifact(out_dir, name="eagle-head", type="model", metadata={"target_weights_hash": hashes["target"]})
    tracker.finish()
    print(f"EAGLE head written to {out_dir} (learning curve: {out_dir / 'learning_curve.png'})")
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(train, cfg)


if __name__ == "__main__":
    main()
