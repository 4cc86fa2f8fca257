"""Logits processing and the acceptance rules of speculative sampling.

Every level of a chain turns its logits into a distribution with the same `Sampling` settings, so the
verifier's p and the proposer's q are the distributions each model would sample from on its own.
Acceptance is min(1, p(x)/q(x)); at the first rejection the token is resampled from
norm(max(0, p - q)); when everything is accepted one bonus token is sampled from p. This makes the
output distributed exactly as the verifier's own sampling (Leviathan et al. 2023). Greedy decoding
(temperature 0) is the limit case: accept while the verifier's argmax equals the draft.

A proposal whose q is `None` is deterministic (prompt lookup, tree drafting): q is one-hot on the
drafted token, so acceptance is p(x) and the residual is p with x removed.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from decode.engine.errors import DecodeError


class SamplingError(DecodeError, ValueError):
    """Sampling settings that define no distribution; the message is one line and names the setting."""


@dataclass(frozen=True)
class Sampling:
    """How one decoding call draws its tokens, passed whole through chains and baselines: temperature >= 0
    (0 = greedy), top_k >= 0 (0 = off), 0 < top_p <= 1 (1 = off), seed an integer or None (unseeded); anything else
    is refused."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for key in ("temperature", "top_p"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise SamplingError(f"{key} must be a finite number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise SamplingError(f"top_k must be an integer, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise SamplingError(f"seed must be an integer or null, got {self.seed!r}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """A generator on `device` seeded with `seed`, or None (torch's global one) for an unseeded call."""
        return torch.Generator(device).manual_seed(self.seed) if self.seed is not None else None


GREEDY = Sampling()


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p (as in HF generate); returns float32 probabilities [..., V]."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, p - q)): what to sample from after q's token was rejected."""
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    # p == q (up to rounding) makes rejection impossible in exact arithmetic; fall back to p itself
    return r / total if total > 0 else p


def verify_greedy(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """logits [len(draft)+1, V]: returns (accepted draft tokens, the verifier's next token)."""
    best = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft) and best[n] == draft[n]:
        n += 1
    return n, best[n]


def verify_sampled(
    p: torch.Tensor, draft: list[int], q: torch.Tensor | None, generator: torch.Generator | None
) -> tuple[int, int]:
    """p [len(draft)+1, V] verifier probabilities, q [len(draft), V] or None (one-hot proposals).

    Returns (accepted draft tokens, the next token: residual sample at the first rejection, else bonus).
    """
    k = len(draft)
    if k:
        idx = torch.arange(k, device=p.device)
        tok = torch.tensor(draft, device=p.device)
        px = p[idx, tok]
        qx = q[idx, tok] if q is not None else torch.ones(k, device=p.device)
        u = torch.rand(k, generator=generator, device=p.device)  # the generator lives on p's device
        rejected = (u * qx > px).nonzero()
        if len(rejected):
            n = int(rejected[0])
            return n, sample(residual(p[n], None if q is None else q[n], draft[n]), generator)
    return k, sample(p[k], generator)


def verify_children(
    p: torch.Tensor, children: list[int], generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """Multi-draft verification at a tree node with deterministic children (Chen et al. / SpecInfer style).

    Tries each child as a one-hot proposal in turn: accept with probability p'(c), else remove c from p'
    and renormalise. Returns (index of the accepted child or None, the final residual distribution),
    which samples exactly from p.
    """
    for i, c in enumerate(children):
        if float(torch.rand((), generator=generator, device=p.device)) < float(p[c]):
            return i, p
        p = residual(p, None, c)
    return None, p
