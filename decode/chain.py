"""The polybasic speculative decoding engine: a chain of levels, Algorithm 1 generalised to n levels.

Level 0 is the target; level i verifies what level i+1 proposes; the last level drafts. A middle level
keeps what it accepts (plus one token of its own) in a pending buffer until it holds `mu` tokens, then
hands the buffer up together with its own distributions, which are the proposal q for the level above.
Every model level keeps its own KV cache: before each forward it crops the cache to the longest prefix
its cached tokens share with the current sequence, so rejected tokens are rolled back and nothing is
recomputed from the start.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from decode import tree as trees
from decode.fast import pack
from decode.head import softcapped, spread, vocabulary_rows
from decode.sampling import Sampling, SamplingError, probabilities, sample, verify_greedy, verify_sampled


class DecodeError(RuntimeError):
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


class Level:
    """One model of the chain. Subclasses implement `draft` (bottom level) and/or `verify`."""

    kind = "level"

    def __init__(self, name: str, mu: int = 1, draft: dict | None = None):
        self.name, self.mu = name, mu
        self.draft_cfg = dict(draft or {"mode": "chain", "length": 4})
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
    """Any HF causal LM (the target, a quantized copy, a smaller model of the same vocabulary)."""

    kind = "model"

    def __init__(self, name: str, model: PreTrainedModel, mu: int = 1, draft: dict | None = None,
                 vocab: torch.Tensor | None = None):
        super().__init__(name, mu, draft)
        self.model = model
        self.keep_hidden = False  # set by the chain when an EAGLE level reads this level's features
        self.set_vocab(vocab)
        self.reset()

    def set_vocab(self, vocab: torch.Tensor | None) -> None:
        """Restrict the level's logits to `vocab` (token ids; None = all): its LM head computes those rows only
        and every other token gets -inf, so it never proposes one. Lossless, as any proposal q is: the level
        above still verifies over its own full vocabulary. Never for the target, whose output it would change."""
        self.vocab = vocab
        self._vocab_rows = None if vocab is None else vocabulary_rows(self.model.get_output_embeddings(), vocab)

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
        if self.draft_cfg.get("mode", "chain") == "tree":
            proposal = trees.build(self._tree_step(ctx), self.draft_cfg, budget)
            # tree nodes sit at tree positions, not sequence positions: drop them from the cache
            crop_cache(self.cache, len(ctx))
            self.tokens = list(ctx)
            if self.hidden is not None:
                self.hidden = self.hidden[:, : len(ctx)]
        else:
            tokens, qs = [], []
            for _ in range(min(int(self.draft_cfg.get("length", 4)), budget)):
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
        k = min(int(self.draft_cfg.get("length", 4)), budget)
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
    """EAGLE draft head: drafts from the features (last hidden states) of the levels above."""

    kind = "eagle"

    def __init__(self, name: str, head: torch.nn.Module, features: Callable | None, draft: dict | None = None):
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
        if self.draft_cfg.get("mode", "chain") == "tree":
            proposal = trees.build(self._tree_step(ctx, hidden, logits), self.draft_cfg, budget)
        else:
            tokens, qs = [], []
            for i in range(min(int(self.draft_cfg.get("length", 4)), budget)):
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
            if levels[i + 1].draft_cfg.get("mode") == "tree" and i + 1 != len(levels) - 1:
                raise DecodeError(f"level {levels[i + 1].name!r}: only the last level can draft a tree")
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

    def features(self, order: list[ModelLevel]) -> Callable[[list[int], int, int], torch.Tensor]:
        """Feature source for an EAGLE level: positions [start, end) of ctx, each from the first level in
        `order` whose hidden states cover it (cached states stay valid while the prefix is unchanged)."""
        for level in order:
            level.keep_hidden = True

        def features(ctx: list[int], start: int, end: int) -> torch.Tensor:
            parts, pos = [], start
            for level in order:
                valid = min(level.hidden_valid(ctx), end)
                if valid > pos:
                    parts.append(level.hidden[:, pos:valid])
                    pos = valid
            if pos < end:
                raise DecodeError(f"no level holds features for positions {pos}..{end - 1}")
            return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0] if parts else self._empty_features()

        return features

    def _empty_features(self) -> torch.Tensor:
        h = self.target.model.config.hidden_size
        return torch.zeros(1, 0, h, dtype=self.target.model.dtype)


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


def load_target(cfg: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The chain's target as configured: `model.name` in `model.dtype`, its linears packed when
    `decode.fast` (decode.fast: the AR reference and every chain then share that same configuration)."""
    from data.models import load_model
    from decode.fast import pack

    target, tokenizer = load_model(cfg.model.name, cfg.model.dtype)
    if cfg.decode.get("fast"):
        pack(target)
    return target, tokenizer


def build_chain(
    chain_cfg: list[dict], target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
    run_dir: str | Path = ".", dtype: str = "float32", fast: bool = False,
) -> Chain:
    """Build a chain from level configs (a list from conf/decode/chain.yaml); level 1 is the target.

    Level keys: kind (model | eagle | ngram), name, mu (middle levels), draft (last level:
    {mode: chain, length} or {mode: tree, depth, top_k, total_tokens}).
    model: `model` (`target`, a model spec or folder; relative folders resolve against run_dir, a GPTQ
    folder loads the same way), `dtype`, `layers` (keep the first n decoder layers: an early-exit copy
    sharing the weights, a stand-in drafter). eagle: `path` (head folder, or `untrained`), `features`
    (nearest: the level above first, then upwards; target: the target first, then downwards).
    ngram: max_ngram, min_ngram. `dtype` is the default for model levels that set none. `fast` packs the
    linears of every model level loaded here (decode.fast; pack the target itself with `load_target`).
    """
    if not chain_cfg:
        raise DecodeError("empty chain: list at least the target and one drafter")
    levels: list[Level] = []
    for i, raw in enumerate(chain_cfg):
        cfg = dict(raw)
        kind, name = cfg.get("kind", "model"), cfg.get("name") or f"L{i + 1}"
        if i == 0 and (kind != "model" or cfg.get("model", "target") != "target" or cfg.get("layers")):
            raise DecodeError(f"level 1 must be the target ({{kind: model, model: target}}), got {raw}")
        if kind == "model":
            model = level_model(cfg, target_model, tokenizer, Path(run_dir), dtype)
            if fast and model is not target_model:
                pack(model)
            levels.append(ModelLevel(name, model, int(cfg.get("mu", 1)), cfg.get("draft")))
        elif kind == "eagle":
            head = _eagle_head(cfg, levels, tokenizer, Path(run_dir), target_model)
            if fast:
                pack(head)
            levels.append(EagleLevel(name, head, None, cfg.get("draft")))
        elif kind == "ngram":
            levels.append(NgramLevel(name, int(cfg.get("max_ngram", 3)), int(cfg.get("min_ngram", 1)), cfg.get("draft")))
        else:
            raise DecodeError(f"level {i + 1} ({name}): unknown kind {kind!r}; use model, eagle or ngram")
    chain = Chain(levels)
    for i, (level, cfg) in enumerate(zip(levels, chain_cfg)):
        if cfg.get("vocab") is not None and isinstance(level, ModelLevel):
            level.set_vocab(_level_vocab(cfg, i, levels))
        if isinstance(level, EagleLevel):
            above = levels[:i][::-1]  # nearest first
            trained_on = getattr(level.head, "feature_source", None)  # what the head was trained on
            source = cfg.get("features") or ("target" if trained_on == "target" else "nearest")
            order = {"nearest": above, "target": above[::-1]}.get(source)
            if order is None:
                raise DecodeError(f"level {level.name!r}: features must be nearest or target, got {source!r}")
            level.features = chain.features(order)
    return chain


def _level_vocab(cfg: dict, i: int, levels: list[Level]) -> torch.Tensor:
    """A middle level's vocabulary (`vocab: head`): the draft vocabulary of the chain's EAGLE head."""
    name = cfg.get("name", f"L{i + 1}")
    if i == 0:
        raise DecodeError(f"level {name!r}: the target cannot have a restricted vocabulary (it would change the output)")
    if cfg["vocab"] != "head":
        raise DecodeError(f"level {name!r}: vocab must be 'head' (the EAGLE head's draft vocabulary), got {cfg['vocab']!r}")
    heads = [l.head for l in levels if isinstance(l, EagleLevel) and l.head.draft_vocab is not None]
    if not heads:
        raise DecodeError(f"level {name!r}: vocab: head needs an EAGLE level whose head has a draft vocabulary")
    return heads[0].draft_vocab


def level_model(cfg: dict, target: PreTrainedModel, tokenizer, run_dir: Path, dtype: str) -> PreTrainedModel:
    spec = str(cfg.get("model", "target"))
    if spec == "target":
        model = target
    else:
        from data.models import ModelSourceError, load_model, same_vocabulary

        path = Path(spec).expanduser()
        if not spec.startswith(("bundled:", "hf:")) and not path.is_absolute() and not path.exists():
            if (run_dir / path).exists() or "/" not in spec or (run_dir / path.parts[0]).exists():
                spec = str(run_dir / path)  # a run artifact such as `w4` (missing: "no such model folder")
        try:
            model, level_tokenizer = load_model(spec, dtype=str(cfg.get("dtype") or dtype))
        except ModelSourceError as err:
            raise DecodeError(f"level {cfg.get('name', spec)!r}: {err}") from None
        if not same_vocabulary(tokenizer, level_tokenizer):
            raise DecodeError(f"level {cfg.get('name', spec)!r}: {spec} has a different vocabulary than the target")
    if model.config.vocab_size != target.config.vocab_size:
        raise DecodeError(f"level {cfg.get('name', spec)!r}: vocab size {model.config.vocab_size} != target's {target.config.vocab_size}")
    if cfg.get("layers"):
        model = truncated_copy(model, int(cfg["layers"]))
    return model


def truncated_copy(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """The same model with only its first `layers` decoder layers (then the final norm and head).

    Shares every weight with `model`; a cheap, partially agreeing stand-in drafter."""
    import copy

    total = model.config.num_hidden_layers
    if not 0 < layers < total:
        raise DecodeError(f"layers must be between 1 and {total - 1} for this model, got {layers}")
    decoder = model.get_decoder()
    kept = decoder.layers[:layers]
    full, decoder.layers = decoder.layers, torch.nn.ModuleList()
    try:
        clone = copy.deepcopy(model)  # copies everything but the (now empty) layer list
    finally:
        decoder.layers = full
    clone.get_decoder().layers = kept  # the same layer modules: weights are shared, not copied
    clone.config.num_hidden_layers = layers
    for attr in ("layer_types",):
        if getattr(clone.config, attr, None):
            setattr(clone.config, attr, clone.config.layer_types[:layers])
    return clone.eval()


def _eagle_head(cfg: dict, levels: list[Level], tokenizer, run_dir: Path, target: PreTrainedModel):
    from decode.head import EagleHead

    path = str(cfg.get("path", "eagle"))
    if not levels:
        raise DecodeError("an EAGLE level needs a model level above it")
    if path == "untrained":
        return EagleHead.for_target(target).eval()
    folder = Path(path).expanduser()
    if not folder.is_absolute() and not folder.exists():
        folder = run_dir / folder
    if not folder.exists():
        raise DecodeError(f"{folder}: no EAGLE head folder (train one with python -m train.eagle)")
    try:
        return EagleHead.from_pretrained(str(folder), target, tokenizer).eval()
    except (OSError, ValueError, RuntimeError) as err:
        raise DecodeError(f"{folder}: cannot load the EAGLE head ({str(err).splitlines()[0]})") from None
