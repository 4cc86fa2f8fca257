"""The polybasic speculative decoding engine: a chain of levels, Algorithm 1 generalised to n levels.

Level 0 is the target; level i verifies what level i+1 proposes; the last level drafts. A middle level
keeps what it accepts (plus one token of its own) in a pending buffer until it holds `mu` tokens, then
hands the buffer up together with its own distributions, which are the proposal q for the level above.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable

import torch

from decode.engine.errors import DecodeError
from decode.engine.levels import (Features, Generation, GenerationStats, Level, ModelLevel,
                                  Proposal)
from decode.engine.sampling import GREEDY, Sampling


class Chain:
    """levels[0] is the target; levels[-1] drafts; everything between verifies and proposes."""

    def __init__(self, levels: list[Level]):
        if len(levels) < 2:
            raise DecodeError("a chain needs at least two levels: the target and a drafter")
        if not isinstance(levels[0], ModelLevel) or not all(isinstance(level, ModelLevel) for level in levels[:-1]):
            raise DecodeError("every level but the last must be a model level (only models verify)")
        for i, level in enumerate(levels[:-1]):
            if level.mu < 1:
                raise DecodeError(f"level {level.name!r}: mu must be >= 1, got {level.mu}")
            if levels[i + 1].draft_spec.mode == "tree" and i + 1 != len(levels) - 1:
                raise DecodeError(f"level {levels[i + 1].name!r}: only the last level can draft a tree")
        drafter, draft = levels[-1], levels[-1].draft_spec
        missing = draft.missing()
        if missing:
            raise DecodeError(f"level {drafter.name!r}: a {draft.mode} draft needs {', '.join(missing)} "
                              "(decode.draft_defaults fills in what a configured chain leaves out)")
        self.levels = levels
        self.target = levels[0]

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
        eos_token_id: int | list[int] | None = None, on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """Decode up to max_new_tokens after prompt_ids; distributed exactly as the target's own decoding.

        `on_tokens` receives each block of tokens the target commits (streaming; may overshoot the limits
        by the last block, the returned tokens do not)."""
        check_new_tokens(max_new_tokens)
        gen = sampling.generator(self.target.device)
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


def read_features(order: list[ModelLevel], feature_size: int, dtype: torch.dtype) -> Features:
    """Feature source for an EAGLE level: positions [start, end) of ctx, each from the first level in `order`
    whose kept features cover it (cached ones stay valid while the prefix is unchanged), `feature_size` wide. Every
    level in `order` must have been built with keep_hidden (True, or EAGLE-3's layer ids)."""
    forgetful = [level.name for level in order if not level.keep_hidden]
    if forgetful:
        raise DecodeError(f"levels {', '.join(forgetful)} do not keep their hidden states "
                          "(build them keeping features: ModelLevel.keeping)")
    empty = torch.zeros(1, 0, feature_size, dtype=dtype, device=order[0].device if order else "cpu")

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


def check_new_tokens(max_new_tokens: Any) -> None:
    """A one-line DecodeError unless max_new_tokens is an integer >= 1."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise DecodeError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
