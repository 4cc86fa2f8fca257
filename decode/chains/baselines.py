"""Baselines behind the chain's API: plain autoregressive decoding of the target (the reference every
speedup is measured against, and the greedy reference for losslessness), and transformers' own
`generate` with an assistant model or with prompt lookup (what a user would try first)."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from infra.device import synchronized_clock
from decode.engine.levels import Generation, GenerationStats, LevelStats

from decode.engine.chain import check_new_tokens
from decode.engine.runner import Prepared, Runner, as_prepared
from decode.engine.sampling import GREEDY, Sampling, probabilities, sample
from heads.eagle import softcapped


def _eos_set(eos_token_id: int | list[int] | None) -> set[int]:
    return set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])


def _truncate(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


Choose = Callable[[torch.Tensor, int], int]  # (the logits at a position, how many tokens came before) -> a token


def autoregressive(
    target: PreTrainedModel | Prepared, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY,
    eos_token_id: int | list[int] | None = None, runner: Runner | None = None,
) -> Generation:
    """One token per forward with a KV cache, sampling with the same logits processing as the chain; the target runs
    as a chain's target level does (a runner of the prepared target, its LM head): the reference is the chain's own
    forward. `runner`: one of the target's to reuse, reset first (a CUDA runner keeps its captured graphs); None: a
    new one."""
    prepared = as_prepared(target)
    gen = sampling.generator(prepared.model.device)

    def choose(logits: torch.Tensor, _: int) -> int:
        return int(logits.argmax()) if sampling.greedy else sample(probabilities(logits, sampling), gen)

    return _one_token_at_a_time(prepared, prompt_ids, max_new_tokens, eos_token_id, runner, choose)


def greedy_margins(
    target: PreTrainedModel | Prepared, prompt_ids: list[int], forced: list[int], max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> tuple[list[int], list[tuple[float, list[int]]]]:
    """Greedy decoding as `autoregressive` runs it, taking the `forced` tokens in place of its first choices; with
    each position's relative top-2 margin and top-2 tokens, read from the logits of the forward that chose the token
    there: the near-tie check's evidence comes from the arithmetic that decided, not from another forward that may
    round differently."""
    margins: list[tuple[float, list[int]]] = []

    def choose(logits: torch.Tensor, position: int) -> int:
        top = torch.topk(logits.float(), 2)
        a, b = top.values.tolist()
        margins.append(((a - b) / max(abs(a), 1e-12), top.indices.tolist()))
        return forced[position] if position < len(forced) else int(logits.argmax())

    tokens = _one_token_at_a_time(as_prepared(target), prompt_ids, max_new_tokens, eos_token_id, None, choose).tokens
    return tokens, margins


def _one_token_at_a_time(prepared: Prepared, prompt_ids: list[int], max_new_tokens: int, eos_token_id: Any,
                         runner: Runner | None, choose: Choose) -> Generation:
    """The loop both references share: a prefill, then one-token forwards, each token `choose`n from its logits."""
    check_new_tokens(max_new_tokens)
    model, device = prepared.model, prepared.model.device
    head, new, ttft = prepared.lm_head, [], 0.0
    runner = runner or prepared.new_runner()
    eos, stats = _eos_set(eos_token_id), LevelStats("target", "model", type(runner).__name__)
    runner.reset()
    ids = list(prompt_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        while len(new) < max_new_tokens and not (new and new[-1] in eos):
            t0 = synchronized_clock(device)
            hidden = runner.forward(torch.tensor([ids], device=device), None, None)
            logits = softcapped(head(hidden[:, -1:]), model.config)[0, -1]
            if new:  # as in the chain, stats describe decoding steps; the prefill is time_to_first_token_s
                stats.forward_calls += 1
                stats.verify_time_s += synchronized_clock(device) - t0
            new.append(choose(logits, len(new)))
            ids = [new[-1]]
            if len(new) == 1:
                ttft = time.perf_counter() - start
    wall = time.perf_counter() - start
    stats.bookkeeping_time_s = wall - ttft - stats.verify_time_s
    return Generation(new, GenerationStats(wall, ttft, len(new), 0.0, [stats]))


class _FirstTokenClock(BaseStreamer):
    """Records when generate emits its first new token (its first put is the prompt)."""

    def __init__(self, start: float):
        self.start, self.calls, self.ttft = start, 0, 0.0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.ttft = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def _hf_generate(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                 eos_token_id: int | list[int] | None, name: str, **settings: Any) -> Generation:
    """transformers' generate with the chain's sampling; `settings` go to its GenerationConfig, except
    `assistant_model`, which generate takes itself."""
    check_new_tokens(max_new_tokens)
    eos, sampled = _eos_set(eos_token_id), not sampling.greedy
    assistant = {"assistant_model": settings.pop("assistant_model")} if "assistant_model" in settings else {}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sampled, temperature=sampling.temperature if sampled else None,
        top_k=sampling.top_k if sampled else None, top_p=sampling.top_p if sampled else None,
        eos_token_id=sorted(eos) or None, pad_token_id=min(eos) if eos else 0, **settings,
    )
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    start = time.perf_counter()
    clock = _FirstTokenClock(start)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=model.device), generation_config=config, streamer=clock,
                             **assistant)
    wall = time.perf_counter() - start
    new = _truncate(out[0, len(prompt_ids):].tolist(), max_new_tokens, eos)
    return Generation(new, GenerationStats(wall, clock.ttft, len(new), 0.0, [LevelStats(name, "hf", "generate")]))


def hf_assisted(
    model: PreTrainedModel, assistant: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int,
    sampling: Sampling = GREEDY, eos_token_id: int | list[int] | None = None,
) -> Generation:
    """transformers' assisted generation (one assistant model, its own draft-length schedule)."""
    return _hf_generate(model, prompt_ids, max_new_tokens, sampling, eos_token_id, "hf_assisted",
                        assistant_model=assistant)


def hf_prompt_lookup(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int, prompt_lookup_num_tokens: int = 10,
    sampling: Sampling = GREEDY, eos_token_id: int | list[int] | None = None,
) -> Generation:
    """transformers' prompt lookup decoding (n-gram drafts copied from the context)."""
    return _hf_generate(model, prompt_ids, max_new_tokens, sampling, eos_token_id, "hf_prompt_lookup",
                        prompt_lookup_num_tokens=prompt_lookup_num_tokens)
