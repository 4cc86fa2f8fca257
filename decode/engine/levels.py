"""The levels of a chain: a model level (any causal LM, through a runner), an EAGLE head, prompt lookup.

Every model level keeps its own KV cache (in its runner): before each forward it crops the cache to the longest
prefix its cached tokens share with the current sequence, so rejected tokens are rolled back and nothing is
recomputed from the start. Every level is complete when constructed: nothing changes it afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from infra.device import synchronized_clock
from decode.engine import tree as trees
from decode.engine.errors import DecodeError
from decode.engine.runner import Prepared, PreparedHead, Runner, as_prepared, as_prepared_head
from decode.engine.spec import Draft
from decode.engine.sampling import Sampling, probabilities, sample, verify_greedy, verify_sampled
from heads.eagle import softcapped, spread, vocabulary_rows


@dataclass
class LevelStats:
    """One level's work in one generation, after the prefill (whose time is time_to_first_token_s)."""

    name: str
    kind: str
    runner: str = ""  # what computed its forwards (a Runner's class name; "" for a model-free level): reports say it
    forward_calls: int = 0
    draft_time_s: float = 0.0  # forwards spent proposing tokens
    verify_time_s: float = 0.0  # forwards spent verifying the level below
    bookkeeping_time_s: float = 0.0  # the level's Python work outside forwards (acceptance, cache crops)
    acceptance_lengths: list[int] = field(default_factory=list)  # per verification call, bonus included (L_i)
    proposed: int = 0  # tokens the level below proposed to this level
    accepted: int = 0  # of those, accepted
    # (tokens fed, seconds) of each forward (decode.chains.plan)
    forwards: list[tuple[int, float]] = field(default_factory=list)

    @property
    def mean_forward_time_s(self) -> float:  # T_i
        return (self.draft_time_s + self.verify_time_s) / max(self.forward_calls, 1)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def acceptance_variance(self) -> float:
        n, m = len(self.acceptance_lengths), self.mean_acceptance_length
        return sum((x - m) ** 2 for x in self.acceptance_lengths) / max(n - 1, 1)


@dataclass
class GenerationStats:
    wall_time_s: float
    time_to_first_token_s: float
    new_tokens: int
    draft_depth: float = 0.0  # β: drafter forwards per verification round of the level above it
    levels: list[LevelStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def beside_forwards_s(self) -> float:
        """Decoding time after the prefill spent outside every level's forwards: the engine's own work per decode."""
        forwards = sum(level.draft_time_s + level.verify_time_s for level in self.levels)
        return self.wall_time_s - self.time_to_first_token_s - forwards


@dataclass
class Generation:
    tokens: list[int]  # new tokens only (up to and including EOS, at most max_new_tokens)
    stats: GenerationStats


def choose(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None, qs: list[torch.Tensor]) -> int:
    """A drafted token: the argmax when greedy, else a sample whose distribution joins qs (the proposal q)."""
    if sampling.greedy:
        return int(logits.argmax())
    qs.append(probabilities(logits, sampling))
    return sample(qs[-1], gen)


@dataclass
class Proposal:
    """What a level hands to the level above: tokens (or a tree) and the proposer's distributions."""

    tokens: list[int]
    q: torch.Tensor | None = None  # [len(tokens), V]; None = deterministic (one-hot) proposals
    tree: trees.Tree | None = None


def tree_proposal(tree: trees.Tree | None) -> Proposal:
    """A drafted tree as a proposal (None: nothing drafted)."""
    return Proposal([]) if tree is None else Proposal(tree.tokens, tree=tree)


Features = Callable[[list[int], int, int], torch.Tensor]  # (ctx, start, end) -> [1, end - start, h]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Level:
    """One model of the chain. Subclasses implement `draft` (bottom level) and/or `verify`.

    `draft` (the last level's, a spec.Draft or its mapping): {mode: chain, length} or {mode: tree, depth, top_k,
    total_tokens}; mode is chain unless set."""

    kind = "level"

    def __init__(self, name: str, mu: int = 1, draft: Draft | dict | None = None):
        self.name, self.mu, self.draft_spec = name, mu, Draft.of(draft)
        self.reset_stats()

    def reset(self) -> None:
        self.reset_stats()

    def reset_stats(self) -> None:
        runner = getattr(self, "runner", None)  # set by model and EAGLE levels (after this first runs)
        self.stats = LevelStats(self.name, self.kind, "" if runner is None else type(runner).__name__)

    def draft(self, ctx: list[int], budget: int, sampling: Sampling, gen: torch.Generator | None) -> Proposal:
        raise DecodeError(f"level {self.name!r} ({self.kind}) cannot draft")

    def verify(self, ctx, proposal, sampling, gen, record=True) -> tuple[list[int], torch.Tensor | None]:
        raise DecodeError(f"level {self.name!r} ({self.kind}) cannot verify; only model levels can")

    def _record(self, proposed: int, accepted: int, record: bool) -> None:
        if record:
            self.stats.acceptance_lengths.append(accepted + 1)
            self.stats.proposed += proposed
            self.stats.accepted += accepted


@dataclass(frozen=True)
class LevelCompute:
    """How a model level computes, where it differs from its prepared model's: its runner (decoder and KV cache)
    and its LM head (e.g. a vocabulary's rows). None: a new runner of the prepared model, its LM head."""

    runner: Runner | None = None
    lm_head: nn.Module | None = None


class ModelLevel(Level):
    """Any HF causal LM (the target, a quantized copy, a smaller model of the same vocabulary), run by a `Runner`.

    `vocab` restricts the level's logits to those token ids (None = all): its LM head computes those rows only
    and every other token gets -inf, so it never proposes one. Lossless, as any proposal q is: the level above
    still verifies over its own full vocabulary. Never for the target, whose output it would change.
    `keeping(keep_hidden)`: keep the features of the cached tokens for an EAGLE level below (`read_features`): True,
    the last hidden states (EAGLE-2); a tuple of layer ids, the states entering those layers side by side (EAGLE-3's
    aux states, which the runner captures)."""

    kind = "model"

    def __init__(self, name: str, model: PreTrainedModel | Prepared, mu: int = 1, draft: Draft | dict | None = None,
                 vocab: torch.Tensor | None = None, compute: LevelCompute = LevelCompute()):
        """`model` as a backend prepared it (a plain model runs as transformers does); `compute.runner` defaults
        to a new runner of it, `compute.lm_head` to its LM head, or with `vocab` the rows of it for those ids (a
        backend passes faster versions of either)."""
        super().__init__(name, mu, draft)
        prepared = as_prepared(model)
        self.model, self.vocab, self.keep_hidden = prepared.model, vocab, False
        self.runner = compute.runner or prepared.new_runner()
        head = prepared.lm_head
        self.lm_head = compute.lm_head or (head if vocab is None else vocabulary_rows(head, vocab))
        self.config, self.device = self.model.config, self.runner.device
        self.reset()

    def keeping(self, keep_hidden: bool | tuple[int, ...]) -> "ModelLevel":
        """This level, keeping the features an EAGLE level below reads (see the class docstring); returns itself."""
        self.keep_hidden = keep_hidden
        if isinstance(keep_hidden, tuple):
            self.runner.capture(keep_hidden)
        return self

    def reset(self) -> None:
        super().reset()
        self.runner.reset()
        self.tokens: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.hidden: torch.Tensor | None = None  # [1, len(tokens), h or 3h] the features kept, if keep_hidden

    def hidden_valid(self, ctx: list[int]) -> int:
        return common_prefix(self.tokens, ctx) if self.hidden is not None else 0

    def forward(self, ctx: list[int], n_logits: int, phase: str, tree: trees.Tree | None = None) -> torch.Tensor:
        """Logits [n_logits, V] for the last n_logits positions of ctx (+ the tree's nodes, if given)."""
        nodes = tree.tokens if tree else []
        keep = min(common_prefix(self.tokens, ctx), len(ctx), len(ctx) + len(nodes) - n_logits)
        self.runner.crop(keep)
        mask = tree.attention_mask(keep, len(ctx), self.runner.dtype, device=self.device) if tree else None
        positions = tree.position_ids(keep, len(ctx), device=self.device) if tree else None
        logits = self._run(ctx[keep:] + nodes, n_logits, phase, mask, positions)
        self.tokens = ctx + nodes
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = softcapped(self.lm_head(hidden), self.config)
        return logits if self.vocab is None else spread(logits, self.vocab, self.config.vocab_size, float("-inf"))

    def _run(self, ids, n_logits, phase, mask=None, positions=None) -> torch.Tensor:
        """One forward of `ids` on top of the cache, timed; keeps the last hidden states if asked."""
        before = self.runner.cached()
        start = synchronized_clock(self.device)
        h = self.runner.forward(torch.tensor([ids], device=self.device), mask, positions)
        logits = self._logits(h[0, -n_logits:])
        elapsed = synchronized_clock(self.device) - start
        self.stats.forward_calls += 1
        self.stats.forwards.append((len(ids), elapsed))
        if phase == "draft":
            self.stats.draft_time_s += elapsed
        else:
            self.stats.verify_time_s += elapsed
        if self.keep_hidden:
            kept = self.runner.captured if isinstance(self.keep_hidden, tuple) else h
            fresh = self.hidden is None or before == 0
            self.hidden = kept if fresh else torch.cat([self.hidden[:, :before], kept], dim=1)
        return logits

    def verify(self, ctx, proposal, sampling, gen, record=True):
        start, fwd = time.perf_counter(), self.stats.draft_time_s + self.stats.verify_time_s
        if proposal.tree is not None:
            tokens, dists, path = self._verify_tree(ctx, proposal.tree, sampling, gen)
        else:
            logits = self.forward(ctx + proposal.tokens, len(proposal.tokens) + 1, "verify")
            if sampling.greedy:
                n, nxt = verify_greedy(logits, proposal.tokens)
                dists = None
            else:
                p = probabilities(logits, sampling)
                n, nxt = verify_sampled(p, proposal.tokens, proposal.q, gen)
                dists = p[: n + 1]
            tokens = proposal.tokens[:n] + [nxt]
        self._record(len(proposal.tokens), len(tokens) - 1, record)
        self._bookkeeping(start, fwd)
        return tokens, dists

    def _verify_tree(self, ctx, tree, sampling, gen):
        logits = self.forward(ctx, len(tree.tokens) + 1, "verify", tree=tree)
        path, nxt, dists = trees.walk(tree, logits, sampling, gen)
        # keep the accepted path's keys/values, drop the other branches: no recomputation
        base = len(ctx)
        keep = torch.tensor(list(range(base)) + [base + i for i in path], device=self.device)
        self.runner.keep(keep)
        if self.keep_hidden:
            self.hidden = self.hidden.index_select(1, keep)
        accepted = [tree.tokens[i] for i in path]
        self.tokens = ctx + accepted
        return accepted + [nxt], dists, path

    def draft(self, ctx, budget, sampling, gen):
        start, fwd = time.perf_counter(), self.stats.draft_time_s + self.stats.verify_time_s
        if self.draft_spec.mode == "tree":
            proposal = tree_proposal(trees.build(self._tree_step(ctx), self.draft_spec, budget))
            # tree nodes sit at tree positions, not sequence positions: drop them from the cache
            self.runner.crop(len(ctx))
            self.tokens = list(ctx)
            if self.hidden is not None:
                self.hidden = self.hidden[:, : len(ctx)]
        else:
            tokens, qs = [], []
            for _ in range(min(self.draft_spec.length, budget)):
                logits = self.forward(ctx + tokens, 1, "draft")[-1]
                tokens.append(choose(logits, sampling, gen, qs))
            proposal = Proposal(tokens, torch.stack(qs) if qs else None)
        self._bookkeeping(start, fwd)
        return proposal

    def _tree_step(self, ctx):
        base = len(ctx)

        def step(tree: trees.Tree | None, lo: int, hi: int) -> torch.Tensor:
            if tree is None:
                return torch.log_softmax(self.forward(ctx, 1, "draft")[-1].float(), -1)
            mask = tree.attention_mask(base, base, self.runner.dtype, lo, hi, self.device)
            logits = self._run(
                tree.tokens[lo:hi], hi - lo, "draft", mask, tree.position_ids(base, base, lo, hi, self.device)
            )
            return torch.log_softmax(logits.float(), -1)

        return step

    def _bookkeeping(self, start: float, fwd_before: float) -> None:
        fwd = self.stats.draft_time_s + self.stats.verify_time_s - fwd_before
        self.stats.bookkeeping_time_s += time.perf_counter() - start - fwd


class NgramLevel(Level):
    """Model-free drafter: copy the continuation of the latest earlier occurrence of the last n tokens."""

    kind = "ngram"

    def __init__(self, name: str, max_ngram: int = 3, min_ngram: int = 1, draft: Draft | dict | None = None):
        super().__init__(name, 1, draft)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, ctx, budget, sampling, gen):
        start = time.perf_counter()
        k = min(self.draft_spec.length, budget)
        tokens: list[int] = []
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            pattern = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i : i + n] == pattern:
                    tokens = ctx[i + n : i + n + k]
                    break
            if tokens:
                break
        self.stats.forward_calls += 1  # one "forward" = one lookup, so β and T_n stay defined
        self.stats.draft_time_s += time.perf_counter() - start
        return Proposal(tokens)


class EagleLevel(Level):
    """EAGLE draft head (EAGLE-2's or EAGLE-3's): drafts from `features`, what the model levels above kept for it
    (read_features: their last hidden states, or EAGLE-3's aux states), then from its own output."""

    kind = "eagle"

    def __init__(self, name: str, head: torch.nn.Module | PreparedHead, features: Features,
                 draft: Draft | dict | None = None):
        """`head`: as a backend prepared it (its runner and LM head: Backend.prepare_head), or a plain head module on
        its own forward."""
        super().__init__(name, 1, draft)
        prepared = as_prepared_head(head)
        self.head, self.lm_head, self.runner = prepared.head, prepared.lm_head, prepared.new_runner()
        self.features = features
        self.device = next(self.head.parameters()).device
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.runner.reset()
        self.tokens: list[int] = []  # head position t holds (feature of t, token t+1) for tokens[:t+2]

    def _head(self, ids: list[int], feats: torch.Tensor, positions: list[int], mask: torch.Tensor | None = None):
        start = synchronized_clock(self.device)
        hidden = self.runner.forward(torch.tensor([ids], device=self.device), feats, mask,
                                     torch.tensor([positions], device=self.device))
        logits = self.head.logits(hidden, self.lm_head)
        elapsed = synchronized_clock(self.device) - start
        self.stats.forward_calls += 1
        self.stats.forwards.append((len(ids), elapsed))
        self.stats.draft_time_s += elapsed
        return hidden, logits

    def _prefill(self, ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the positions with real features the head has not seen; return the last (hidden, logits)."""
        real = len(ctx) - 1  # positions 0..len-2 have verifier features
        keep = max(min(common_prefix(self.tokens, ctx) - 1, real - 1), 0)
        self.runner.crop(keep)
        feats = self.features(ctx, keep, real)
        hidden, logits = self._head(ctx[keep + 1 :], feats, list(range(keep, real)))
        self.tokens = list(ctx)
        return hidden[:, -1:], logits[0, -1]

    def draft(self, ctx, budget, sampling, gen):
        start, fwd = time.perf_counter(), self.stats.draft_time_s
        if len(ctx) < 2 or budget <= 0:
            return Proposal([])
        real = len(ctx) - 1
        hidden, logits = self._prefill(ctx)
        if self.draft_spec.mode == "tree":
            proposal = tree_proposal(trees.build(self._tree_step(ctx, hidden, logits), self.draft_spec, budget))
        else:
            tokens, qs = [], []
            for i in range(min(self.draft_spec.length, budget)):
                if i:
                    h, lg = self._head([tokens[-1]], hidden, [real + i - 1])
                    hidden, logits = h[:, -1:], lg[0, -1]
                index = choose(logits, sampling, gen, qs)  # a position in the head's draft vocabulary
                tokens.append(int(self.head.token_ids(torch.tensor(index, device=self.device))))
            proposal = Proposal(tokens, self.head.full_vocab(torch.stack(qs)) if qs else None)
        self.runner.crop(real)  # drafted positions used predicted features: never keep them
        self.stats.bookkeeping_time_s += time.perf_counter() - start - (self.stats.draft_time_s - fwd)
        return proposal

    def _tree_step(self, ctx, root_hidden, root_logits):
        real = len(ctx) - 1
        node_hidden: list[torch.Tensor] = []  # predicted feature of each fed node's position

        def step(tree: trees.Tree | None, lo: int, hi: int) -> torch.Tensor:
            if tree is None:
                return self._full_log_probs(root_logits)
            feats = torch.cat([node_hidden[p] if p >= 0 else root_hidden for p in tree.parents[lo:hi]], dim=1)
            mask = tree.attention_mask(real, real, feats.dtype, lo, hi, self.device)
            hidden, logits = self._head(
                tree.tokens[lo:hi], feats, tree.position_ids(real, real, lo, hi)[0].tolist(), mask
            )
            node_hidden.extend(hidden[:, i : i + 1] for i in range(hi - lo))
            return self._full_log_probs(logits[0])

        return step

    def _full_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the full vocabulary (-inf outside the head's draft vocabulary)."""
        logp = torch.log_softmax(logits.float(), -1)
        if self.head.draft_vocab is None:
            return logp
        return spread(logp, self.head.draft_vocab, self.head.config.vocab_size, float("-inf"))
