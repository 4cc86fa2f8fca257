"""`python -m train.eagle`: train the EAGLE-2 (or, `train=eagle3`, EAGLE-3) draft head against its verifier (DeepSpeed).

Features are the verifier's last hidden states (the target's, or the W4 model's with
`train.feature_source=w4`, since in the polybasic chain the head drafts for M2), computed once into a
feature store (train/store.py) so that epochs cost only the head's own forward and backward. Loss on
assistant tokens: SmoothL1 on the next feature + weighted cross-entropy against the verifier's
next-token distribution over the head's draft vocabulary (`train.draft_vocab` most frequent reply
tokens), with uniform noise on the input features. Held-out evaluations during training form a
learning curve (metrics.json, W&B, learning_curve.png in the head folder).

`train.method=eagle3` (conf/train/eagle3.yaml) trains vLLM's EAGLE-3 head (heads/eagle3.py) with the same
machinery: the store adds the verifier's states entering `train.aux_layers` and its argmax; the loss is SpecForge's
training-time test over `train.unroll` = k steps, each fed its own previous output (train/evaluation.py's unroll):
step i's loss is -sum p log q against the verifier's distribution p renormalised over the draft vocabulary, at loss
positions whose verifier argmax lies in that vocabulary, weighted 0.8^i. Its store and checkpoints live beside
EAGLE-2's (eagle3_features, eagle3_checkpoints), so the two never evict each other.

`EagleRecipe` holds one run's state (setup, train, evaluate, save) over its frozen settings (train/settings.py, read
once from the config by `main`); data, held-out evaluation, checkpoints and the plot live in train/examples.py,
train/evaluation.py, train/checkpoints.py and train/plot.py.

Always runs through `deepspeed.initialize`: plain `python -m train.eagle` is a one-process group (gloo on the CPU,
NCCL on a GPU: `device`, conf/config.yaml); `torchrun --nproc_per_node=2 -m train.eagle` is data-parallel (each
optimizer step's global batch is split across ranks, so the result does not depend on how many processes share
it; on GPUs each rank trains on its LOCAL_RANK's GPU). The verifiers load on the device in `model.dtype` (bfloat16
there halves a large target's memory); the feature store stays in host memory and each micro batch's features go
to the device as it is trained.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import asdict, replace
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import PreTrainedModel

from data.models import first_names, load_model, nonfinite_tensors, same_vocabulary, weights_hash
from data.settings import ModelSettings
from data.sharegpt import load_split
from heads.eagle import FORMAT_VERSION, DraftHead, EagleHead, TrainingRecord, head_layer, vocabulary_rows
from heads.eagle3 import Eagle3Head, check_aux_layers, default_aux_layers
from infra.cli import flag, run_main
from infra.layout import RunLayout
from infra.logs import chatter_to
from infra.tracking import Tracker
from train import store
from train.checkpoints import Progress, StopFlag, checkpoint_fingerprint, resume_progress, save_checkpoint
from train.distributed import Share, backend_for, collective_device, training_device
from train.errors import TrainError, TrainingInterrupted
from train.evaluation import EvalSequence, evaluate_head, evaluate_on_rank0, prepare_eval, unroll
from train.examples import Example, draft_vocabulary, load_examples, pad, step_micro_batches
from train.fit import fit_to_memory
from train.plot import learning_curve_png
from train.settings import RUN_CONTROL_KEYS, EagleTraining, TrainSettings, of
from train.store import FeatureSource

def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size): torchrun's environment, or a one-process group set up here (NCCL on a GPU, gloo on the
    CPU). DeepSpeed places the head on LOCAL_RANK's accelerator: a single process on cuda:N says N, and a process
    on the CPU of a GPU machine keeps DeepSpeed on the CPU (DS_ACCELERATOR, read when deepspeed is imported)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK=str(device.index or 0))
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend_for(device), verbose=False)
    return dist.get_rank(), dist.get_world_size()


def load_verifiers(model: ModelSettings, feature_source: str, layout: RunLayout,
                   device: torch.device) -> tuple[PreTrainedModel, Any, PreTrainedModel]:
    """(target, its tokenizer, the feature model): the target itself or the W4 model in quantize.output."""
    target, tokenizer = load_model(model.name, model.dtype, device)
    if feature_source == "target":
        return target, tokenizer, target
    w4_path = layout.output("w4")
    if not (w4_path / "config.json").is_file():
        raise TrainError(f"{w4_path}: no W4 model there "
                         "(run `python -m quantize.w4` first, or use train.feature_source=target)")
    w4, w4_tokenizer = load_model(str(w4_path), model.dtype, device)
    if not same_vocabulary(tokenizer, w4_tokenizer) or w4.config.hidden_size != target.config.hidden_size:
        raise TrainError(f"{w4_path}: the W4 model's vocabulary or hidden size differs from the target "
                         f"{model.name}")
    return target, tokenizer, w4


def written_features(examples: list[Example], t: EagleTraining, aux_layers: tuple[int, ...]) -> list | None:
    """The store's features as the verifier's replies brought them (train.replies=verifier, one rank), where the
    store wants just those: the feature model's own last hidden states, no aux layers."""
    features = [e.features for e in examples]
    usable = t.store_compute == "model" and not aux_layers and all(f is not None for f in features)
    return features if usable else None


def micro_batch_loss(head: Any, feats: torch.Tensor, ids: torch.Tensor, loss_mask: torch.Tensor,
                     t: EagleTraining, noise_seed: int) -> tuple[torch.Tensor, dict[str, float]]:
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
    noise = noise.to(feats.device)  # drawn on the CPU: the same noise on every device
    loss, stats = torch.zeros((), device=feats.device), {"feature_loss": 0.0, "ce": 0.0}
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


TTT_DECAY = 0.8  # step i of the training-time test weighs 0.8^i (SpecForge, EAGLE-3)


def ttt_loss(head: Any, batch: dict[str, torch.Tensor], depth: int, target_rows: torch.nn.Module,
             in_vocab: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-3's training-time test on one micro batch (`batch`: ids, loss_mask and the store's aux, features,
    argmax): `depth` steps from every start, step i from the head's own step i-1 output; its loss is -sum p log q
    with p the verifier's distribution over the draft vocabulary (`target_rows`: its LM head's rows for it, on the
    stored last hidden state), at loss positions whose verifier argmax is in the draft vocabulary (`in_vocab` [V]);
    the total is sum 0.8^i L_i."""
    module = head.module if hasattr(head, "module") else head
    ids, loss_mask = batch["ids"], batch["loss_mask"]
    n = ids.shape[1] - 1 - depth
    loss, stats = torch.zeros((), device=ids.device), {"feature_loss": 0.0, "ce": 0.0}
    for i, hidden in enumerate(unroll(head, ids, batch["aux"][:, :n], depth)):
        j = i + 1  # this step predicts token t + j + 1 from the verifier's distribution at position t + j
        mask = loss_mask[:, j + 1:n + j + 1] & in_vocab[batch["argmax"][:, j:n + j]]
        logits = module.logits(hidden[mask]).float()
        with torch.no_grad():
            target_p = torch.softmax(
                target_rows(batch["features"][:, j:n + j][mask].to(target_rows.weight.dtype)).float(), -1)
        ce = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1).mean() if logits.shape[0] else logits.sum()
        loss = loss + TTT_DECAY ** i * ce
        stats["ce"] += ce.item() / depth
        if i == 0:
            stats["correct"] = (logits.argmax(-1) == target_p.argmax(-1)).sum().item()
            stats["predicted"] = int(mask.sum())
    return loss, {"loss": loss.item(), **stats}


def lr_multiplier(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup, then cosine decay to min_ratio of the peak learning rate."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def deepspeed_config(t: EagleTraining) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def head_is_current(settings: TrainSettings, target_hash: str) -> bool:
    """True when train.output holds a finished head for this target and this training config."""
    out_dir = settings.run.layout.output("eagle")
    try:
        saved = json.loads((out_dir / "config.json").read_text()).get("polyspec", {})
        json.loads((out_dir / "metrics.json").read_text())
    except (OSError, ValueError, AttributeError):
        return False
    trained = saved.get("training", {})
    # where, not what
    same = all(trained.get(k) == v for k, v in settings.record().items() if k not in (*RUN_CONTROL_KEYS, "output"))
    return (same and saved.get("format_version") == FORMAT_VERSION
            and saved.get("target", {}).get("weights_hash") == target_hash)


def aux_layers(t: EagleTraining, target: PreTrainedModel) -> tuple[int, ...]:
    """The layers whose entering states an EAGLE-3 head reads (train.aux_layers, or vLLM's default); () for EAGLE-2."""
    if t.method != "eagle3":
        return ()
    n, layers = target.config.num_hidden_layers, t.aux_layers
    return check_aux_layers(layers if layers is not None else default_aux_layers(n), n)


def check_init(t: EagleTraining, target: PreTrainedModel) -> None:
    """train.init=target_last_layer needs a head layer of the target's own class, which a mixture-of-experts target's
    head (a dense Llama layer: heads.eagle.head_layer) is not; refused before the feature store is built."""
    if t.init != "target_last_layer":
        return
    own, last = head_layer(target)[0], type(getattr(target, target.base_model_prefix).layers[-1])
    if own is not last:
        raise TrainError(f"train.init=target_last_layer: {type(target).__name__}'s head is a dense {own.__name__}, "
                         f"not a copy of its {last.__name__}; set train.init=random")


def new_head(t: EagleTraining, target: PreTrainedModel, vocab: torch.Tensor | None) -> DraftHead:
    """A fresh head: random (EAGLE's init) or `train.init=target_last_layer`: the decoder layer copied from
    the target's last layer and fc passing the feature half through unchanged. EAGLE-3: random, its LM head the
    target's rows for the draft vocabulary."""
    if t.method == "eagle3":
        return Eagle3Head(target, draft_vocab=vocab, aux_layers=aux_layers(t, target))
    head = EagleHead(target, draft_vocab=vocab)
    if t.init == "target_last_layer":
        last = getattr(target, target.base_model_prefix).layers[-1].state_dict()
        head.layer.load_state_dict({k: v for k, v in last.items() if not k.startswith("input_layernorm.")})
        h = head.config.hidden_size
        with torch.no_grad():
            head.fc.weight[:, h:].copy_(torch.eye(h))
    return head


def curve_point(progress: Progress, evaluation: dict[str, float]) -> dict[str, float]:
    """One point of the learning curve: held-out top-1 per depth and acceptance length at `tokens_seen`."""
    if not evaluation:  # ranks other than 0 do not evaluate
        return {}
    length = next(v for k, v in evaluation.items() if k.startswith("acceptance_length_depth"))
    return {"step": progress.step, "tokens_seen": progress.tokens_seen, "acceptance_length": length,
            **{k: v for k, v in evaluation.items() if k.startswith("top1_depth")}}


class EagleRecipe:
    """One training run of the head, its state on self: `setup` loads the verifiers, data, feature store, head and
    DeepSpeed engine (or finds the head already current), `train` runs the optimizer steps from where the run stands
    (held-out evaluations, checkpoints, Ctrl-C), `save` writes the head with its final evaluation (rank 0).
    DeepSpeed's own output, and GPTQModel's when a W4 verifier loads, go to a file of the run's library_logs
    (infra.logs), to the terminal with `verbose`."""

    def __init__(self, settings: TrainSettings, verbose: bool = False):
        self.settings, self.t, self.layout = settings, settings.train, settings.run.layout
        self.chatter = None if verbose else self.layout.library_logs / "train.eagle.log"
        method = self.t.method  # each method keeps its own store and checkpoints in the run dir
        self.store_root, self.checkpoints = ((self.layout.feature_store, self.layout.checkpoints) if method == "eagle"
                                             else (self.layout.run_dir / f"{method}_features",
                                                   self.layout.run_dir / f"{method}_checkpoints"))
        self.tracker: Tracker | None = None
        self.eval_sequences: list[EvalSequence] = []

    def setup(self) -> bool:
        """Everything the steps need; False (and nothing loaded beyond the target) when train.output is current."""
        device = training_device(self.settings.run.device)
        with chatter_to(self.chatter):
            self.rank, self.world = init_distributed(device)
        if self.chatter and self.rank == 0:
            print(f"train.eagle: DeepSpeed's own output goes to {self.chatter} (verbose=true: to the terminal)")
        self.settings = replace(self.settings, train=fit_to_memory(self.t, device, self.settings.token_cap, self.rank))
        self.t = self.settings.train
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        torch.manual_seed(self.settings.run.seed)
        split = load_split(self.settings.data)  # the data before any model: a bad source is refused in seconds
        with chatter_to(self.chatter):
            self.target, self.tokenizer, feature_model = load_verifiers(self.settings.model, self.t.feature_source,
                                                                        self.layout, device)
        check_init(self.t, self.target)
        self.hashes = {"target": weights_hash(self.target)}
        if self.t.skip_if_valid and head_is_current(self.settings, self.hashes["target"]):
            return False
        self.hashes["features"] = self.hashes["target"] if feature_model is self.target else weights_hash(feature_model)
        source, share = FeatureSource(feature_model, self.hashes["features"]), Share(self.rank, self.world)
        self.examples, prompts = load_examples(self.settings, self.tokenizer, source, share, split)
        self.total_steps = self._total_steps()
        self.aux_layers = aux_layers(self.t, self.target)
        settings = store.StoreSettings(self.store_root, self.t.store_dtype, self.t.store_batch, self.aux_layers)
        self.features = store.build_or_load(store.computing_in(source, self.t.store_compute),
                                            [e.input_ids for e in self.examples], settings, share,
                                            written_features(self.examples, self.t, self.aux_layers))
        self.examples = [replace(e, features=None) for e in self.examples]  # the store holds them now
        self.head = new_head(self.t, self.target, draft_vocabulary(self.t.draft_vocab, self.examples, self.tokenizer,
                                                                   self.target.config.vocab_size, self.rank))
        self._verifier_rows(feature_model)
        with chatter_to(self.chatter):
            self.engine, self.scheduler = self._engine(deepspeed)
        self.progress = resume_progress(self.engine, self.settings, self.checkpoints, self.world, self.total_steps,
                                        self.rank)
        if self.rank == 0:
            self.tracker = Tracker(self.settings.run.tracking, "train.eagle")
            print(f"train.eagle: {len(self.examples)} conversations, {self.total_steps} steps of {self._per_step()} "
                  f"(micro {self.t.micro_batch} x accum {self.t.grad_accum} x {self.world} ranks), "
                  f"features from {self.t.feature_source}")
            self.eval_sequences = prepare_eval(feature_model, self.tokenizer, prompts, self.t.eval.gen_tokens,
                                               self.t.eval.batch, self.aux_layers)
        if not self.progress.curve:
            self.progress.curve.append(curve_point(self.progress, self.evaluate()))
            if self.rank == 0:
                print(f"untrained head: held-out acceptance length {self.progress.curve[0]['acceptance_length']:.3f}")
        return True

    def _verifier_rows(self, feature_model: PreTrainedModel) -> None:
        """EAGLE-3's loss target: the verifier's LM-head rows for the head's draft vocabulary (frozen) and which
        tokens that vocabulary holds."""
        if not self.aux_layers:
            return
        vocab, size = self.head.draft_vocab, self.target.config.vocab_size
        head = feature_model.get_output_embeddings()
        self.target_rows = vocabulary_rows(head, vocab if vocab is not None
                                           else torch.arange(size, device=head.weight.device))
        self.in_vocab = torch.zeros(size, dtype=torch.bool, device=head.weight.device)
        self.in_vocab[vocab if vocab is not None else slice(None)] = True

    def _per_step(self) -> int:
        return self.t.micro_batch * self.t.grad_accum * self.world

    def _total_steps(self) -> int:
        total = self.t.max_steps or (self.t.epochs * len(self.examples)) // self._per_step()
        if total < 1:
            raise TrainError(f"{len(self.examples)} training conversations cannot fill one step of {self._per_step()} "
                             "(micro_batch x grad_accum x ranks)")
        return total

    def _engine(self, deepspeed: Any) -> tuple[Any, Any]:
        t = self.t
        optimizer = torch.optim.AdamW(self.head.parameters(), lr=t.lr, betas=tuple(t.betas),
                                      weight_decay=t.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_multiplier(s, self.total_steps, t.warmup_steps, t.min_lr_ratio))
        engine, _, _, _ = deepspeed.initialize(model=self.head, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(t))
        return engine, scheduler

    def evaluate(self) -> dict[str, float]:
        """Held-out top-1 per depth and acceptance length of the head as it is now (rank 0; {} elsewhere)."""
        return evaluate_on_rank0(self.engine.module, self.eval_sequences, self.t.eval.depth, self.rank)

    def train(self) -> None:
        """The optimizer steps from `progress.step` to the last: evaluation, checkpoints, Ctrl-C."""
        stop = StopFlag()
        bar = tqdm(total=self.total_steps, initial=self.progress.step, desc="eagle", disable=self.rank != 0,
                   dynamic_ncols=True)
        try:
            while self.progress.step < self.total_steps:
                self._step()
                bar.set_postfix(loss=f"{self.progress.last['train/loss']:.3f}",
                                top1=f"{self.progress.last['train/top1']:.3f}",
                                tok_s=f"{self.progress.tokens_seen / self.progress.train_seconds:.0f}")
                bar.update()
                if (self.t.eval_every and self.progress.step % self.t.eval_every == 0
                        and self.progress.step < self.total_steps):
                    self._log_evaluation()
                self._checkpoint(stop)
        finally:
            bar.close()
            stop.restore()
            if self.tracker is not None and self.progress.step < self.total_steps:
                self.tracker.finish()
        p = self.progress
        if self.rank == 0:
            print(f"head: {p.step} steps, {p.tokens_seen:,} tokens in {p.train_seconds:.1f} s of training "
                  f"({p.tokens_seen / max(p.train_seconds, 1e-9):,.0f} tokens/s, {self.world} ranks)")

    def _step(self) -> None:
        """One optimizer step, and its metrics on `progress`."""
        started = time.perf_counter()
        sums = self._optimizer_step()
        elapsed = time.perf_counter() - started
        p, micro_batches = self.progress, self.t.grad_accum * self.world
        p.step, p.train_seconds, p.tokens_seen = (p.step + 1, p.train_seconds + elapsed,
                                                  p.tokens_seen + int(sums["tokens"]))
        p.last = {"train/loss": sums["loss"] / micro_batches,
                  "train/feature_loss": sums["feature_loss"] / micro_batches,
                  "train/ce": sums["ce"] / micro_batches, "train/top1": sums["correct"] / max(1, sums["predicted"]),
                  "train/lr": self.scheduler.get_last_lr()[0], "train/tokens_per_s": sums["tokens"] / elapsed}
        if p.nonfinite_step is None and not math.isfinite(p.last["train/loss"]):
            p.nonfinite_step = p.step
        if self.tracker is not None:
            self.tracker.log(p.last, step=p.step)

    def _optimizer_step(self) -> dict[str, float]:
        """One optimizer step over this rank's micro batches; the sums of their statistics over all ranks."""
        t, seed, engine, examples = self.t, self.settings.run.seed, self.engine, self.examples
        engine.train()
        sums = {"loss": 0.0, "feature_loss": 0.0, "ce": 0.0, "correct": 0, "predicted": 0, "tokens": 0}
        for chunk, indices in step_micro_batches(self.progress.step, len(examples), t, seed, self.rank, self.world):
            ids, stored, loss_mask = pad([examples[i] for i in indices], [self.features[i] for i in indices],
                                         all_tokens=t.loss_tokens == "all")
            batch = {"ids": ids, "loss_mask": loss_mask, **stored}
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            if self.aux_layers:
                loss, stats = ttt_loss(engine, batch, t.unroll, self.target_rows, self.in_vocab)
            else:
                loss, stats = micro_batch_loss(engine, batch["features"], batch["ids"], batch["loss_mask"], t,
                                               noise_seed=seed * 1_000_003 + self.progress.step * 1_009 + chunk)
            engine.backward(loss)
            engine.step()
            stats["tokens"] = sum(len(examples[i].input_ids) for i in indices)
            for k in sums:
                sums[k] += stats[k]
        totals = torch.tensor([sums[k] for k in sums], dtype=torch.float64, device=collective_device())
        dist.all_reduce(totals)
        return dict(zip(sums, totals.tolist()))

    def _log_evaluation(self) -> None:
        point = curve_point(self.progress, self.evaluate())
        if self.rank == 0:
            self.progress.curve.append(point)
            self.tracker.log({f"eval/{k}": v for k, v in point.items() if k != "step"}, step=self.progress.step)
            tqdm.write(f"step {self.progress.step}: held-out acceptance length {point['acceptance_length']:.3f}, "
                       f"top-1@1 {point['top1_depth1']:.3f}")

    def _checkpoint(self, stop: StopFlag) -> None:
        """A checkpoint every train.checkpoint_every steps, at the end, and before stopping on Ctrl-C/SIGTERM."""
        ckpt_dir, step = self.checkpoints, self.progress.step
        client = {"progress": asdict(self.progress), "fingerprint": checkpoint_fingerprint(self.settings, self.world)}
        if stop.agreed():
            save_checkpoint(self.engine, ckpt_dir, step, client, self.t.keep_checkpoints, self.rank)
            raise TrainingInterrupted(f"interrupted at step {step}/{self.total_steps}; checkpoint in {ckpt_dir}; "
                                      "continue with train.resume=true")
        if step % self.t.checkpoint_every == 0 or step == self.total_steps:
            save_checkpoint(self.engine, ckpt_dir, step, client, self.t.keep_checkpoints, self.rank)

    def save(self) -> dict[str, Any]:
        """The final evaluation and the head folder (atomic), W&B summary and artifact; the metrics (rank 0)."""
        import deepspeed

        metrics: dict[str, Any] = {}
        with deepspeed.zero.GatheredParameters(list(self.head.parameters())):
            self._check_finite()  # on every rank: each stops alike
            if self.rank == 0:
                metrics = self._write_head()
        dist.barrier()
        return metrics

    def _check_finite(self) -> None:
        """Refuse to write a head with a NaN or infinite weight, naming it and the step the loss went non-finite."""
        bad = nonfinite_tensors(self.head.state_dict())
        if not bad:
            return
        step = self.progress.nonfinite_step
        when = (f"the training loss went non-finite at step {step}; lower train.lr" if step is not None else
                "the training loss stayed finite: a tensor it never reached, left uninitialised")
        raise TrainError(f"the head's weights are not finite ({first_names(bad)}): "
                         f"{when}; nothing is written")

    def _write_head(self) -> dict[str, Any]:
        t, k, progress = self.t, self.t.eval.depth, self.progress
        final = evaluate_head(self.head, self.eval_sequences, k)
        if progress.curve[-1]["step"] != progress.step:
            progress.curve.append(curve_point(progress, final))
        metrics = final_metrics(final, progress, k, len(self.examples), self.world, self.head)
        print(f"held-out acceptance length at depth {k}: {final[f'acceptance_length_depth{k}']:.3f} "
              f"(untrained head: {progress.curve[0]['acceptance_length']:.3f}); "
              + ", ".join(f"top-1@{j} {final[f'top1_depth{j}']:.3f}" for j in range(1, k + 1)))
        training = {**self.settings.record(), "world_size": self.world, "feature_model_hash": self.hashes["features"],
                    "total_steps": self.total_steps}
        out_dir = self.layout.output("eagle")
        record = TrainingRecord(t.feature_source, training, metrics,
                                {"learning_curve.png": learning_curve_png(progress.curve, k)})
        self.head.save_pretrained(out_dir, target_hash=self.hashes["target"], tokenizer=self.tokenizer, record=record)
        self.tracker.summary({key: v for key, v in metrics.items() if key != "curve"})
        self.tracker.log_artifact(out_dir, name="eagle-head", type="model",
                                  metadata={"target_weights_hash": self.hashes["target"]})
        self.tracker.finish()
        print(f"EAGLE head written to {out_dir} (learning curve: {out_dir / 'learning_curve.png'})")
        return metrics


def final_metrics(final: dict[str, float], progress: Progress, depth: int, conversations: int, world: int,
                  head: DraftHead) -> dict[str, Any]:
    """metrics.json of a finished head: the final held-out evaluation, the untrained one, the run's totals."""
    untrained = progress.curve[0]
    return {**{f"eval/{m}": v for m, v in final.items()}, **progress.last,
            f"untrained/acceptance_length_depth{depth}": untrained["acceptance_length"],
            "untrained/top1_depth1": untrained["top1_depth1"],
            "train/steps": progress.step, "train/seconds": progress.train_seconds,
            "train/tokens_seen": progress.tokens_seen,
            "train/tokens_per_s": progress.tokens_seen / max(progress.train_seconds, 1e-9),
            "train/conversations": conversations, "train/world_size": world,
            "draft_vocab": None if head.draft_vocab is None else len(head.draft_vocab), "curve": progress.curve}


def train(settings: TrainSettings, verbose: bool = False) -> dict[str, Any]:
    """Run the stage; returns the final metrics (also in train.output/metrics.json). `verbose`: the libraries' own
    output on the terminal, not in the run's library_logs."""
    recipe = EagleRecipe(settings, verbose)
    if not recipe.setup():
        out = recipe.layout.output("eagle")
        if recipe.rank == 0:
            print(f"EAGLE head in {out} is up to date (same target and training config); skipping")
        return json.loads((out / "metrics.json").read_text())
    recipe.train()
    return recipe.save()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: train(of(cfg), flag(cfg, "verbose", False, TrainError)))


if __name__ == "__main__":
    main()
