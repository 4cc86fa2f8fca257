"""The polybasic speculative decoding engine: a chain of levels, Algorithm 1 generalised to n levels.

Level 0 is the target; level i verifies what level i+1 proposes; the last level drafts. A middle level
keeps what it accepts (plus one token of its own) in a pending buffer until it holds `mu` tokens, then
hands the buffer up together with its own distributions, which are the proposal q for the level above.
Every model level keeps its own KV cache: before each forward it crops the cache to the longest prefix
its cached tokens share with the current sequence, so rejected tokens are rolled back and nothing is
recomputed from the start. Every level is complete when constructed; decode/build.py builds chains from config.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from data.cli import PolyspecError
from decode import tree as trees
from decode.head import softcapped, spread, vocabulary_rows
from decode.sampling import Sampling, SamplingError, probabilities, sample, verify_greedy, verify_sampled


class DecodeError(PolyspecError, RuntimeError):
    """A chain that cannot be built or run; the message is one line, meant for the user."""


@dataclass
class LevelStats:
    """One level's work in one generation, after the prefill (whose time is time_to_first_token_s)."""

    name: str
    kind: str
    forward_calls: int = 0
    draft_time_s: float = 0.0  # forwards spent proposing tokens
    verify_time_s: float = 0.0  # forwards spent verifying the level below
    bookkeeping_time_s: float = 0.0  # the level's Python work outside forwards (acceptance, cache crops)
    acceptance_lengths: list[int] = field(default_factory=list)  # per verification call, bonus included (L_i)
    proposed: int = 0  # tokens the level below proposed to this level
    accepted: int = 0  # of those, accepted
    forwards: list[tuple[int, float]] = field(default_factory=list)  # (tokens fed, seconds) of each forward (decode.plan)

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


def crop_cache(cache: DynamicCache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


# What a drafter's draft must set, by mode (decode.draft_defaults in conf/decode/chain.yaml has the values).
DRAFT_KEYS = {"chain": ("length",), "tree": ("depth", "top_k", "total_tokens")}


class Level:
    """One model of the chain. Subclasses implement `draft` (bottom level) and/or `verify`.

    `draft` (the last level's; see DRAFT_KEYS): {mode: chain, length} or {mode: tree, depth, top_k,
    total_tokens}; mode is chain unless set."""

    kind = "level"

    def __init__(self, name: str, mu: int = 1, draft: dict | None = None):
        self.name, self.mu = name, mu
        self.draft_cfg = {"mode": "chain", **(draft or {})}
        self.stats = LevelStats(name, self.kind)

    def reset(self) -> None:
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = LevelStats(self.name, self.kind)

    def draft(self, ctx: list[int], budget: int, sampling: Sampling, gen: torch.Generator | None) -> Proposal:
        raise DecodeError(f"level {self.name!r} ({self.kind}) cannot draft")

    def verify(self, ctx, proposal, sampling, gen, record=True) -> tuple[list[int], torch.Tensor | None]:
        raise DecodeError(f"level {self.name!r} ({self.kind}) cannot verify; only model levels can")

    def _record(self, proposed: int, accepted: int, record: bool) -> None:
        if record:
            self.stats.acceptance_lengths.append(accepted + 1)
            self.stats.proposed += proposed
            self.stats.accepted += accepted


class ModelLevel(Level):
    """Any HF causal LM (the target, a quantized copy, a smaller model of the same vocabulary).

    `vocab` restricts the level's logits to those token ids (None = all): its LM head computes those rows only
    and every other token gets -inf, so it never proposes one. Lossless, as any proposal q is: the level above
    still verifies over its own full vocabulary. Never for the target, whose output it would change.
    `keep_hidden`: keep the last hidden states of the cached tokens, for an EAGLE level below (`read_features`)."""

    kind = "model"

    def __init__(self, name: str, model: PreTrainedModel, mu: int = 1, draft: dict | None = None,
                 vocab: torch.Tensor | None = None, keep_hidden: bool = False):
        super().__init__(name, mu, draft)
        self.model, self.vocab, self.keep_hidden = model, vocab, keep_hidden
        self._vocab_rows = None if vocab is None else vocabulary_rows(model.get_output_embeddings(), vocab)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.cache = DynamicCache(config=self.model.config)
        self.tokens: list[int] = []  # the tokens whose keys/values the cache holds, in order
        self.hidden: torch.Tensor | None = None  # [1, len(tokens), h] last hidden states, if keep_hidden

    def hidden_valid(self, ctx: list[int]) -> int:
        return common_prefix(self.tokens, ctx) if self.hidden is not None else 0

    def forward(self, ctx: list[int], n_logits: int, phase: str, tree: trees.Tree | None = None) -> torch.Tensor:
        """Logits [n_logits, V] for the last n_logits positions of ctx (+ the tree's nodes, if given)."""
        nodes = tree.tokens if tree else []
        keep = min(common_prefix(self.tokens, ctx), len(ctx), len(ctx) + len(nodes) - n_logits)
        crop_cache(self.cache, keep)
        mask = tree.attention_mask(keep, len(ctx), self.model.dtype) if tree else None
        positions = tree.position_ids(keep, len(ctx)) if tree else None
        logits = self._run(ctx[keep:] + nodes, n_logits, phase, mask, positions)
        self.tokens = ctx + nodes
        return logits

    def _run(self, ids, n_logits, phase, mask=None, positions=None) -> torch.Tensor:
        """One forward of `ids` on top of the cache, timed; keeps the last hidden states if asked."""
        before = self.cache.get_seq_length()
        start = time.perf_counter()
        if self.vocab is None:
            out = self.model(
                input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True, attention_mask=mask,
                position_ids=positions, logits_to_keep=n_logits, output_hidden_states=self.keep_hidden,
            )
            logits, h = out.logits[0], out.hidden_states[-1] if self.keep_hidden else None
        else:  # the decoder, then the vocabulary's LM-head rows only
            h = self.model.get_decoder()(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                                         attention_mask=mask, position_ids=positions).last_hidden_state
            rows = softcapped(self._vocab_rows(h[0, -n_logits:]), self.model.config)
            logits = spread(rows, self.vocab, self.model.config.vocab_size, float("-inf"))
        elapsed = time.perf_counter() - start
        self.stats.forward_calls += 1
        self.stats.forwards.append((len(ids), elapsed))
        if phase == "draft":
            self.stats.draft_time_s += elapsed
        else:
            self.stats.verify_time_s += elapsed
        if self.keep_hidden:
            self.hidden = h if self.hidden is None or before == 0 else torch.cat([self.hidden[:, :before], h], dim=1)
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
        keep = torch.tensor(list(range(base)) + [base + i for i in path])
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(-2, keep), layer.values.index_select(-2, keep)
        if self.keep_hidden:
            self.hidden = self.hidden.index_select(1, keep)
        accepted = [tree.tokens[i] for i in path]
        self.tokens = ctx + accepted
        return accepted + [nxt], dists, path

    def draft(self, ctx, budget, sampling, gen):
        start, fwd = time.perf_counter(), self.stats.draft_time_s + self.stats.verify_time_s
        if self.draft_cfg["mode"] == "tree":
            proposal = tree_proposal(trees.build(self._tree_step(ctx), self.draft_cfg, budget))
            # tree nodes sit at tree positions, not sequence positions: drop them from the cache
            crop_cache(self.cache, len(ctx))
            self.tokens = list(ctx)
            if self.hidden is not None:
                self.hidden = self.hidden[:, : len(ctx)]
        else:
            tokens, qs = [], []
            for _ in range(min(int(self.draft_cfg["length"]), budget)):
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
            mask = tree.attention_mask(base, base, self.model.dtype, lo, hi)
            logits = self._run(tree.tokens[lo:hi], hi - lo, "draft", mask, tree.position_ids(base, base, lo, hi))
            return torch.log_softmax(logits.float(), -1)

        return step

    def _bookkeeping(self, start: float, fwd_before: float) -> None:
        fwd = self.stats.draft_time_s + self.stats.verify_time_s - fwd_before
        self.stats.bookkeeping_time_s += time.perf_counter() - start - fwd


class NgramLevel(Level):
    """Model-free drafter: copy the continuation of the latest earlier occurrence of the last n tokens."""

    kind = "ngram"

    def __init__(self, name: str, max_ngram: int = 3, min_ngram: int = 1, draft: dict | None = None):
        super().__init__(name, 1, draft)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, ctx, budget, sampling, gen):
        start = time.perf_counter()
        k = min(int(self.draft_cfg["length"]), budget)
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
    """EAGLE draft head: drafts from `features`, the last hidden states of the model levels above (read_features)."""

    kind = "eagle"

    def __init__(self, name: str, head: torch.nn.Module, features: Features, draft: dict | None = None):
        super().__init__(name, 1, draft)
        self.head, self.features = head, features
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.cache = DynamicCache()
        self.tokens: list[int] = []  # head position t holds (feature of t, token t+1) for tokens[:t+2]

    def _head(self, ids: list[int], feats: torch.Tensor, positions: list[int], mask: torch.Tensor | None = None):
        start = time.perf_counter()
        hidden, logits, self.cache = self.head(
            torch.tensor([ids]), feats, past_key_values=self.cache,
            position_ids=torch.tensor([positions]), attention_mask=mask,
        )
        elapsed = time.perf_counter() - start
        self.stats.forward_calls += 1
        self.stats.forwards.append((len(ids), elapsed))
        self.stats.draft_time_s += elapsed
        return hidden, logits

    def _prefill(self, ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the positions with real features the head has not seen; return the last (hidden, logits)."""
        real = len(ctx) - 1  # positions 0..len-2 have verifier features
        keep = max(min(common_prefix(self.tokens, ctx) - 1, real - 1), 0)
        crop_cache(self.cache, keep)
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
        if self.draft_cfg["mode"] == "tree":
            proposal = tree_proposal(trees.build(self._tree_step(ctx, hidden, logits), self.draft_cfg, budget))
        else:
            tokens, qs = [], []
            for i in range(min(int(self.draft_cfg["length"]), budget)):
                if i:
                    h, lg = self._head([tokens[-1]], hidden, [real + i - 1])
                    hidden, logits = h[:, -1:], lg[0, -1]
                index = choose(logits, sampling, gen, qs)  # a position in the head's draft vocabulary
                tokens.append(int(self.head.token_ids(torch.tensor(index))))
            proposal = Proposal(tokens, self.head.full_vocab(torch.stack(qs)) if qs else None)
        crop_cache(self.cache, real)  # drafted positions used predicted features: never keep them
        self.stats.bookkeeping_time_s += time.perf_counter() - start - (self.stats.draft_time_s - fwd)
        return proposal

    def _tree_step(self, ctx, root_hidden, root_logits):
        real = len(ctx) - 1
        node_hidden: list[torch.Tensor] = []  # predicted feature of each fed node's position

        def step(tree: trees.Tree | None, lo: int, hi: int) -> torch.Tensor:
            if tree is None:
                return self._full_log_probs(root_logits)
            feats = torch.cat([node_hidden[p] if p >= 0 else root_hidden for p in tree.parents[lo:hi]], dim=1)
            mask = tree.attention_mask(real, real, feats.dtype, lo, hi)
            hidden, logits = self._head(tree.tokens[lo:hi], feats, tree.position_ids(real, real, lo, hi)[0].tolist(), mask)
            node_hidden.extend(hidden[:, i : i + 1] for i in range(hi - lo))
            return self._full_log_probs(logits[0])

        return step

    def _full_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the full vocabulary (-inf outside the head's draft vocabulary)."""
        logp = torch.log_softmax(logits.float(), -1)
        if self.head.draft_vocab is None:
            return logp
        return spread(logp, self.head.draft_vocab, self.head.config.vocab_size, float("-inf"))


class Chain:
    """levels[0] is the target; levels[-1] drafts; everything between verifies and proposes."""

    def __init__(self, levels: list[Level]):
        if len(levels) < 2:
            raise DecodeError("a chain needs at least two levels: the target and a drafter")
        if not isinstance(levels[0], ModelLevel) or not all(isinstance(l, ModelLevel) for l in levels[:-1]):
            raise DecodeError("every level but the last must be a model level (only models verify)")
        for i, level in enumerate(levels[:-1]):
            if level.mu < 1:
                raise DecodeError(f"level {level.name!r}: mu must be >= 1, got {level.mu}")
            if levels[i + 1].draft_cfg["mode"] == "tree" and i + 1 != len(levels) - 1:
                raise DecodeError(f"level {levels[i + 1].name!r}: only the last level can draft a tree")
        drafter, draft = levels[-1], levels[-1].draft_cfg
        if draft["mode"] not in DRAFT_KEYS:
            raise DecodeError(f"level {drafter.name!r}: draft mode must be chain or tree, got {draft['mode']!r}")
        missing = [key for key in DRAFT_KEYS[draft["mode"]] if key not in draft]
        if missing:
            raise DecodeError(f"level {drafter.name!r}: a {draft['mode']} draft needs {', '.join(missing)} "
                              "(decode.draft_defaults fills in what a configured chain leaves out)")
        self.levels = levels
        self.target = levels[0]

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
        top_p: float = 1.0, seed: int | None = None, eos_token_id: int | list[int] | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """Decode up to max_new_tokens after prompt_ids; distributed exactly as the target's own decoding.

        `on_tokens` receives each block of tokens the target commits (streaming; may overshoot the limits
        by the last block, the returned tokens do not)."""
        sampling = decoding_settings(max_new_tokens, temperature, top_k, top_p, seed)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
        for level in self.levels:
            level.reset()
        seq, stop = list(prompt_ids), len(prompt_ids) + max_new_tokens
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = self.target.verify(seq, Proposal([]), sampling, gen, record=False)[0]  # prefill
            ttft = time.perf_counter() - start
            self.target.reset_stats()  # per-level stats describe the decoding rounds; the prefill is ttft
            while True:
                seq += tokens
                if on_tokens:
                    on_tokens(tokens)
                if len(seq) >= stop or eos.intersection(tokens):
                    break
                tokens, _ = self.target.verify(seq, self._propose(1, seq, stop, eos, sampling, gen), sampling, gen)
        return self._result(seq[len(prompt_ids) :], max_new_tokens, eos, time.perf_counter() - start, ttft)

    def _propose(self, i: int, ctx: list[int], stop: int, eos: set[int], sampling, gen) -> Proposal:
        """What level i proposes after ctx: the drafter's draft, or a middle level's pending buffer."""
        level = self.levels[i]
        if i == len(self.levels) - 1:
            return level.draft(ctx, stop - len(ctx) - 1, sampling, gen)
        pending, dists = [], []
        while len(pending) < level.mu and len(ctx) + len(pending) < stop - 1 and not eos.intersection(pending):
            draft = self._propose(i + 1, ctx + pending, stop, eos, sampling, gen)
            tokens, p = level.verify(ctx + pending, draft, sampling, gen)
            pending += tokens
            dists.append(p)
        return Proposal(pending, None if sampling.greedy or not dists else torch.cat(dists))

    def _result(self, new: list[int], max_new: int, eos: set[int], wall: float, ttft: float) -> Generation:
        new = new[:max_new]
        for i, t in enumerate(new):
            if t in eos:
                new = new[: i + 1]
                break
        stats = [level.stats for level in self.levels]
        rounds = len(stats[-2].acceptance_lengths)
        return Generation(new, GenerationStats(wall, ttft, len(new), stats[-1].forward_calls / max(rounds, 1), stats))


def read_features(order: list[ModelLevel], hidden_size: int, dtype: torch.dtype) -> Features:
    """Feature source for an EAGLE level: positions [start, end) of ctx, each from the first level in `order`
    whose kept hidden states cover it (cached states stay valid while the prefix is unchanged). Every level
    in `order` must have been built with keep_hidden=True."""
    forgetful = [level.name for level in order if not level.keep_hidden]
    if forgetful:
        raise DecodeError(f"levels {', '.join(forgetful)} do not keep their hidden states (build them with keep_hidden=True)")
    empty = torch.zeros(1, 0, hidden_size, dtype=dtype)

    def features(ctx: list[int], start: int, end: int) -> torch.Tensor:
        parts, pos = [], start
        for level in order:
            valid = min(level.hidden_valid(ctx), end)
            if valid > pos:
                parts.append(level.hidden[:, pos:valid])
                pos = valid
        if pos < end:
            raise DecodeError(f"no level holds features for positions {pos}..{end - 1}")
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] if parts else empty

    return features


def decoding_settings(max_new_tokens: Any, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
                      seed: Any = None) -> Sampling:
    """The Sampling of one decoding call, after checking its arguments: a one-line DecodeError names the
    first bad one (max_new_tokens >= 1; temperature >= 0, top_k >= 0, 0 < top_p <= 1; seed an integer or None)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise DecodeError(f"seed must be an integer or null, got {seed!r}")
    try:
        return Sampling(temperature, top_k, top_p)
    except SamplingError as err:
        raise DecodeError(str(err)) from None
