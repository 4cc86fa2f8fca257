"""`python -m train.eagle`: train the EAGLE-2 draft head against its verifier's hidden states (DeepSpeed).

Features come online from a no-grad forward of the verifier (the target, or the W4 model with
`train.feature_source=w4`, since at run time the head drafts for M2); an opt-in on-disk cache reuses
them across epochs. Loss on assistant tokens: SmoothL1 on the next feature + weighted cross-entropy
against the verifier's next-token distribution, with uniform noise on the input features.

Always runs through `deepspeed.initialize`: plain `python -m train.eagle` is a one-process gloo group;
`torchrun --nproc_per_node=2 -m train.eagle` is data-parallel (each optimizer step's global batch is
split across ranks, so the result does not depend on how many processes share it).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from data.models import ModelSourceError, load_model, same_vocabulary, weights_hash
from data.sharegpt import DataError, chat_prompt_ids, load_conversations, split_conversations, tokenize_conversation
from data.tracking import Tracker
from decode.head import EagleHead, HeadError, additive_mask

FEATURE_SOURCES = ("target", "w4")
PRECISIONS = ("fp32", "bf16")
ZERO_STAGES = (0, 1, 2, 3)


class TrainError(RuntimeError):
    """A bad training config or state; the message is one line, meant for the user."""


class TrainingInterrupted(Exception):
    """Ctrl-C (or SIGTERM) stopped training after a checkpoint was written."""


# ---------------------------------------------------------------- config and setup

def validate(cfg: DictConfig) -> None:
    t = cfg.train
    if t.feature_source not in FEATURE_SOURCES:
        raise TrainError(f"train.feature_source={t.feature_source!r}: must be one of {', '.join(FEATURE_SOURCES)}")
    if t.zero_stage not in ZERO_STAGES:
        raise TrainError(f"train.zero_stage={t.zero_stage}: DeepSpeed ZeRO stage must be one of 0, 1, 2, 3")
    if t.precision not in PRECISIONS:
        raise TrainError(f"train.precision={t.precision!r}: must be one of {', '.join(PRECISIONS)}")
    for key in ("micro_batch", "grad_accum", "epochs", "max_len", "checkpoint_every"):
        if not isinstance(t[key], int) or t[key] < 1:
            raise TrainError(f"train.{key}={t[key]!r}: must be a positive integer")
    if not isinstance(t.eval.depth, int) or t.eval.depth < 1:
        raise TrainError(f"train.eval.depth={t.eval.depth!r}: must be a positive integer")


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
    """(target, its tokenizer, the feature model): the target itself or the W4 model in ${run_dir}/w4."""
    target, tokenizer = load_model(cfg.model.name, cfg.model.dtype)
    if cfg.train.feature_source == "target":
        return target, tokenizer, target
    w4_path = Path(cfg.run_dir) / "w4"
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


def load_examples(cfg: DictConfig, tokenizer: Any) -> tuple[list[Example], list[list[int]]]:
    """Training conversations (tokenized, masked, capped) and held-out chat prompts for evaluation."""
    train, held_out = split_conversations(load_conversations(cfg.data.source), cfg.data.held_out_fraction)
    caps = [c for c in (cfg.data.get("max_conversations"), cfg.train.max_conversations) if c]
    train = train[: min(caps)] if caps else train
    max_len = min(cfg.data.max_len, cfg.train.max_len)
    examples = []
    for conv in train:
        tok = tokenize_conversation(tokenizer, conv, max_len)
        if len(tok.input_ids) >= 3 and any(tok.loss_mask[2:]):
            examples.append(Example(tok.id, torch.tensor(tok.input_ids), torch.tensor(tok.loss_mask, dtype=torch.bool)))
    if not examples:
        raise TrainError(f"{cfg.data.source}: no training conversation with assistant tokens")
    prompts = []
    for conv in held_out:
        first_reply = next(i for i, t in enumerate(conv.turns) if t.role == "assistant")
        ids = chat_prompt_ids(tokenizer, conv.messages()[:first_reply])
        if len(ids) <= cfg.train.eval.max_prompt_len:
            prompts.append(ids)
        if len(prompts) == cfg.train.eval.conversations:
            break
    return examples, prompts


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


def pad(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, loss_mask) of a micro batch."""
    L = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), L, dtype=torch.long)
    attn = torch.zeros(len(examples), L, dtype=torch.long)
    loss = torch.zeros(len(examples), L, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n], attn[b, :n], loss[b, :n] = e.input_ids, 1, e.loss_mask
    return ids, attn, loss


class Features:
    """The verifier's last hidden states for a micro batch: online, or from the opt-in on-disk cache."""

    def __init__(self, model: PreTrainedModel, cache_dir: Path | None):
        self.model = model
        self.base = getattr(model, model.base_model_prefix, model)
        self.cache_dir = cache_dir

    @torch.no_grad()
    def __call__(self, examples: list[Example], ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        files = [self._file(e) for e in examples] if self.cache_dir else []
        if files and all(f.exists() for f in files):
            feats = torch.zeros(*ids.shape, self.model.config.hidden_size, dtype=self.model.dtype)
            for b, f in enumerate(files):
                x = load_file(str(f))["features"]
                feats[b, : len(x)] = x
            return feats
        feats = self.base(input_ids=ids, attention_mask=attn).last_hidden_state
        for b, f in enumerate(files):
            if not f.exists():
                tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
                save_file({"features": feats[b, : int(attn[b].sum())].contiguous()}, str(tmp))
                tmp.replace(f)
        return feats

    def _file(self, e: Example) -> Path:
        return self.cache_dir / f"{hashlib.sha1(e.id.encode()).hexdigest()[:20]}.safetensors"


def prepare_cache(cfg: DictConfig, feature_model: PreTrainedModel, feature_hash: str, examples: list[Example], rank: int) -> Path | None:
    """The feature-cache folder (keyed by the feature model's weights), after printing its size."""
    if not cfg.train.feature_cache:
        return None
    max_len = min(cfg.data.max_len, cfg.train.max_len)
    cache_dir = Path(cfg.run_dir) / "eagle_features" / f"{cfg.train.feature_source}-{feature_hash}-len{max_len}"
    tokens = sum(len(e.input_ids) for e in examples)
    size = tokens * feature_model.config.hidden_size * feature_model.dtype.itemsize
    if rank == 0:
        print(f"feature cache: {tokens:,} tokens x {feature_model.config.hidden_size} x {feature_model.dtype} "
              f"= {size / 2**20:,.1f} MiB in {cache_dir}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir


# ---------------------------------------------------------------- loss

def micro_batch_loss(head: Any, lm_head: torch.nn.Module, feats: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                     t: DictConfig, noise_seed: int) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE loss of one micro batch: (f_t + noise, x_{t+1}) -> f_{t+1} and p(x_{t+2}), assistant tokens only."""
    feats_in, feat_target = feats[:, :-2], feats[:, 1:-1]
    mask = loss_mask[:, 2:]
    noise = (torch.rand(feats_in.shape, generator=torch.Generator().manual_seed(noise_seed)) - 0.5) * t.noise
    hidden, _, _ = head(ids[:, 1:-1], feats_in + noise.to(feats_in.dtype), compute_logits=False)
    hidden, feat_target = hidden[mask].float(), feat_target[mask].float()
    logits = head.module.logits(hidden) if hasattr(head, "module") else head.logits(hidden)
    with torch.no_grad():
        target_probs = torch.softmax(lm_head(feat_target.to(lm_head.weight.dtype)).float(), dim=-1)
    feature_loss = F.smooth_l1_loss(hidden, feat_target)
    ce = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    loss = t.feature_weight * feature_loss + t.ce_weight * ce
    correct = (logits.argmax(-1) == target_probs.argmax(-1)).sum().item()
    return loss, {"loss": loss.item(), "feature_loss": feature_loss.item(), "ce": ce.item(),
                  "correct": correct, "predicted": int(mask.sum()), "tokens": int(ids.numel())}


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
def prepare_eval(model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]], gen_tokens: int) -> list[EvalSequence]:
    """Held-out prompts continued greedily by the verifier: on such text, a chain draft is accepted
    exactly while the head's argmax equals the verifier's, so acceptance is measured, not approximated."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for i in range(0, len(prompts), 8):
        group = prompts[i: i + 8]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        gen = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=gen_tokens, do_sample=False,
                             pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id)
        for p, row in zip(group, gen[:, width:].tolist()):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            seq = torch.tensor([p + row])
            features = getattr(model, model.base_model_prefix)(input_ids=seq).last_hidden_state
            greedy = model.get_output_embeddings()(features).argmax(-1)
            out.append(EvalSequence(seq[0], features[0], greedy[0], len(p)))
    return out


@torch.no_grad()
def chain_drafts(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth-`depth` chain drafts from every start s of a sequence: [depth, n] with n = len(ids) - 1 - depth.

    Start s: the head has the verifier's features up to position s and the accepted token s+1; depth
    j feeds back its own predicted feature and the token at s+j (which an accepted draft equals).
    One head call per depth drafts all starts at once: a tree mask lets each start's query see the
    verifier's features up to s and its own earlier depths only, which is what decoding computes.
    """
    n = len(ids) - 1 - depth
    cache = DynamicCache()
    hidden, logits, _ = head(ids[None, 1:n + 1], features[None, :n], cache)
    drafts = [logits[0].argmax(-1)]
    s = torch.arange(n)
    for j in range(2, depth + 1):
        past = cache.get_seq_length()
        allowed = torch.zeros(n, past + n, dtype=torch.bool)
        allowed[:, :n] = s[None, :] <= s[:, None]
        for d in range(2, j + 1):  # this start's own drafts at depths 2..j, each depth n keys wide
            allowed[s, (d - 1) * n + s] = True
        mask = additive_mask(allowed, head.fc.weight.dtype)[None, None]
        hidden, logits, _ = head(ids[None, j:n + j], hidden, cache, position_ids=(s + j - 1)[None], attention_mask=mask)
        drafts.append(logits[0].argmax(-1))
    return torch.stack(drafts)


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
    keys = ("feature_source", "max_conversations", "max_len", "epochs", "max_steps", "lr", "warmup_steps", "min_lr_ratio")
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
    """True when ${run_dir}/eagle holds a finished head for this target and this training config."""
    out_dir = Path(cfg.run_dir) / "eagle"
    try:
        saved = json.loads((out_dir / "config.json").read_text())
        json.loads((out_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = {**OmegaConf.to_container(cfg.train, resolve=True), "seed": cfg.seed,
              "data": OmegaConf.to_container(cfg.data, resolve=True)}
    trained = saved.get("training", {})
    same = all(trained.get(k) == v for k, v in wanted.items() if k not in RUN_CONTROL_KEYS)
    return same and saved.get("target", {}).get("weights_hash") == target_hash


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the stage; returns the final metrics (also in ${run_dir}/eagle/metrics.json)."""
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
            print(f"EAGLE head in {Path(cfg.run_dir) / 'eagle'} is up to date (same target and training config); skipping")
        return json.loads((Path(cfg.run_dir) / "eagle" / "metrics.json").read_text())
    feature_hash = target_hash if feature_model is target else weights_hash(feature_model)
    examples, prompts = load_examples(cfg, tokenizer)
    per_step = t.micro_batch * t.grad_accum * world
    total_steps = t.max_steps or (t.epochs * len(examples)) // per_step
    if total_steps < 1:
        raise TrainError(f"{len(examples)} training conversations cannot fill one step of {per_step} (micro_batch x grad_accum x ranks)")
    features = Features(feature_model, prepare_cache(cfg, feature_model, feature_hash, examples, rank))
    lm_head = feature_model.get_output_embeddings()

    head = EagleHead(target)
    optimizer = torch.optim.AdamW(head.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, total_steps, t.warmup_steps, t.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=head, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(t))

    ckpt_dir = Path(cfg.run_dir) / "eagle_checkpoints"
    fingerprint = checkpoint_fingerprint(cfg, world)
    step, untrained = 0, None
    if t.resume and (ckpt_dir / "latest").is_file():
        tag = (ckpt_dir / "latest").read_text().strip()
        _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if client is None:
            raise TrainError(f"{ckpt_dir / tag}: unreadable checkpoint")
        if client["fingerprint"] != fingerprint:
            changed = sorted(k for k in fingerprint if client["fingerprint"].get(k) != fingerprint[k])
            raise TrainError(f"{ckpt_dir / tag}: written with a different training setup ({', '.join(changed)} changed); resume needs the same")
        step, untrained = client["step"], client["untrained_eval"]
        if rank == 0:
            print(f"resumed from {ckpt_dir / tag} at step {step}/{total_steps}")
    elif t.resume and rank == 0:
        print(f"train.resume=true but no checkpoint in {ckpt_dir}; starting at step 0")

    tracker = Tracker(cfg, "train.eagle") if rank == 0 else None
    eval_sequences = []
    if rank == 0:
        print(f"train.eagle: {len(examples)} conversations, {total_steps} steps of {per_step} "
              f"(micro {t.micro_batch} x accum {t.grad_accum} x {world} ranks), features from {t.feature_source}")
        eval_sequences = prepare_eval(feature_model, tokenizer, prompts, t.eval.gen_tokens)
    if untrained is None:
        untrained = evaluate_on_rank0(head, eval_sequences, t.eval.depth, rank)
        if rank == 0:
            print(f"untrained head: held-out acceptance length {untrained[f'acceptance_length_depth{t.eval.depth}']:.3f}")
    stop = StopFlag()
    train_seconds, tokens_seen, last = 0.0, 0, {}
    bar = tqdm(total=total_steps, initial=step, desc="eagle", disable=rank != 0, dynamic_ncols=True)
    try:
        while step < total_steps:
            engine.train()
            started = time.perf_counter()
            sums = {"loss": 0.0, "feature_loss": 0.0, "ce": 0.0, "correct": 0, "predicted": 0, "tokens": 0}
            for chunk, indices in step_micro_batches(step, len(examples), t, cfg.seed, rank, world):
                batch = [examples[i] for i in indices]
                ids, attn, loss_mask = pad(batch)
                feats = features(batch, ids, attn)
                loss, stats = micro_batch_loss(engine, lm_head, feats, ids, loss_mask, t,
                                               noise_seed=cfg.seed * 1_000_003 + step * 1_009 + chunk)
                engine.backward(loss)
                engine.step()
                for k in sums:
                    sums[k] += stats[k]
            totals = torch.tensor([sums[k] for k in sums], dtype=torch.float64)
            dist.all_reduce(totals)
            sums = dict(zip(sums, totals.tolist()))
            micro_batches = t.grad_accum * world
            step += 1
            elapsed = time.perf_counter() - started
            train_seconds += elapsed
            tokens_seen += int(sums["tokens"])
            last = {"train/loss": sums["loss"] / micro_batches, "train/feature_loss": sums["feature_loss"] / micro_batches,
                    "train/ce": sums["ce"] / micro_batches, "train/top1": sums["correct"] / max(1, sums["predicted"]),
                    "train/lr": scheduler.get_last_lr()[0], "train/tokens_per_s": sums["tokens"] / elapsed}
            bar.set_postfix(loss=f"{last['train/loss']:.3f}", top1=f"{last['train/top1']:.3f}",
                            tok_s=f"{tokens_seen / train_seconds:.0f}")
            bar.update()
            if rank == 0:
                tracker.log(last, step=step)
            if t.eval_every and step % t.eval_every == 0 and step < total_steps:
                during = evaluate_on_rank0(head, eval_sequences, t.eval.depth, rank)
                if rank == 0:
                    tracker.log({f"eval/{k}": v for k, v in during.items()}, step=step)
                    tqdm.write(f"step {step}: held-out acceptance length {during[f'acceptance_length_depth{t.eval.depth}']:.3f}, "
                               f"top-1@1 {during['top1_depth1']:.3f}")
            client = {"step": step, "fingerprint": fingerprint, "untrained_eval": untrained}
            if stop.agreed():
                save_checkpoint(engine, ckpt_dir, step, client, t.keep_checkpoints, rank)
                raise TrainingInterrupted(f"interrupted at step {step}/{total_steps}; checkpoint in {ckpt_dir}; continue with train.resume=true")
            if step % t.checkpoint_every == 0 or step == total_steps:
                save_checkpoint(engine, ckpt_dir, step, client, t.keep_checkpoints, rank)
    finally:
        bar.close()
        stop.restore()
        if tracker is not None and step < total_steps:
            tracker.finish()

    metrics: dict[str, Any] = {}
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        if rank == 0:
            metrics = finish(cfg, head, eval_sequences, untrained, last, step, train_seconds, tokens_seen,
                             len(examples), world, target_hash, feature_hash, tokenizer, total_steps, tracker)
    dist.barrier()
    return metrics


def finish(cfg: DictConfig, head: EagleHead, eval_sequences: list[EvalSequence], untrained: dict, last: dict,
           step: int, train_seconds: float, tokens_seen: int, conversations: int, world: int, target_hash: str,
           feature_hash: str, tokenizer: Any, total_steps: int, tracker: Tracker) -> dict[str, Any]:
    """Final held-out evaluation, the head folder (atomic) and the W&B summary/artifact; rank 0 only."""
    t = cfg.train
    out_dir = Path(cfg.run_dir) / "eagle"
    final = evaluate(head, eval_sequences, t.eval.depth)
    k = t.eval.depth
    metrics = {**{f"eval/{m}": v for m, v in final.items()}, **last,
               f"untrained/acceptance_length_depth{k}": untrained[f"acceptance_length_depth{k}"],
               "train/steps": step, "train/seconds_this_run": train_seconds,
               "train/tokens_per_s_this_run": tokens_seen / max(train_seconds, 1e-9),
               "train/conversations": conversations, "train/world_size": world}
    print(f"held-out acceptance length at depth {k}: {final[f'acceptance_length_depth{k}']:.3f} "
          f"(untrained head: {untrained[f'acceptance_length_depth{k}']:.3f}); "
          + ", ".join(f"top-1@{j} {final[f'top1_depth{j}']:.3f}" for j in range(1, k + 1)))
    training = {**OmegaConf.to_container(t, resolve=True), "seed": cfg.seed, "world_size": world,
                "data": OmegaConf.to_container(cfg.data, resolve=True), "feature_model_hash": feature_hash,
                "total_steps": total_steps}
    head.save_pretrained(out_dir, target_hash=target_hash, tokenizer=tokenizer,
                         feature_source=t.feature_source, training=training, metrics=metrics)
    tracker.summary(metrics)
    tracker.log_artifact(out_dir, name="eagle-head", type="model", metadata={"target_weights_hash": target_hash})
    tracker.finish()
    print(f"EAGLE head written to {out_dir}")
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except TrainingInterrupted as stopped:
        print(str(stopped), file=sys.stderr)
        sys.exit(130)
    except (TrainError, HeadError, ModelSourceError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
