"""What the chain needs to know of a W4 model to decide whether it earns its place (docs/design.md, "Theory"):
held-out perplexity, greedy agreement with the target and the acceptance length L(M1 <- M2) it implies, forward
time at 1 and 8 new tokens, size; and the stage's printed table of them."""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infra.timing import cached_forward, median_ms
from data.sharegpt import Conversation, TokenizedConversation, chat_prompt_ids, tokenize_conversation
from quantize.errors import QuantizeError
from quantize.settings import W4Evaluation


@torch.no_grad()
def perplexity(model: PreTrainedModel, convs: list[TokenizedConversation]) -> float:
    """Perplexity on the assistant-reply tokens (what a chain level predicts when it decodes a reply)."""
    nll, count = 0.0, 0
    for conv in tqdm(convs, desc="perplexity", leave=False):
        ids = torch.tensor([conv.input_ids], device=model.device)
        mask = torch.tensor(conv.loss_mask[1:], dtype=torch.bool, device=model.device)
        logits = model(ids).logits[0, :-1].float()
        nll += F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum").item()
        count += int(mask.sum())
    return math.exp(nll / max(count, 1))


@torch.no_grad()
def greedy_continuation(model: PreTrainedModel, prompt: list[int], n: int, eos: int | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=n,
        do_sample=False, eos_token_id=eos, pad_token_id=eos,
    )
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced_matches(model: PreTrainedModel, prompt: list[int], continuation: list[int]) -> list[bool]:
    """Whether `model`'s argmax equals the next token of `continuation`, at each of its positions."""
    logits = model(torch.tensor([prompt + continuation], device=model.device)).logits[0, len(prompt) - 1 : -1]
    return (logits.argmax(-1) == torch.tensor(continuation, device=model.device)).tolist()


def acceptance_lengths(matches: list[bool], depth: int) -> list[int]:
    """Greedy speculative rounds of a depth-`depth` draft against the target's greedy continuation.

    While the draft agrees, its own greedy tokens are the target's, so the tokens accepted per round are
    the run of teacher-forced matches (capped at depth) plus the verifier's own token. Only rounds whose
    whole window lies inside the continuation are counted."""
    lengths, pos = [], 0
    while pos + depth < len(matches):
        run = 0
        while run < depth and matches[pos + run]:
            run += 1
        lengths.append(run + 1)
        pos += run + 1
    return lengths


@torch.no_grad()
def forward_ms(models: dict[str, PreTrainedModel], context: list[int], new_tokens: list[int], repeats: int,
               warmup: int = 2) -> dict[str, dict[int, float]]:
    """Median ms of one forward of `n` new tokens over a KV cache of `context`, models interleaved per repeat."""
    return median_ms({name: cached_forward(model, context) for name, model in models.items()}, new_tokens, repeats,
                     warmup)


def folder_mb(path: str | Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.suffix == ".safetensors") / 2**20


def evaluate_w4(
    target: PreTrainedModel, w4: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, held_out: list[Conversation],
    settings: W4Evaluation,
) -> dict[str, Any]:
    ppl_convs = [t for t in (tokenize_conversation(tokenizer, c, settings.ppl_max_len)
                             for c in held_out[: settings.ppl_conversations]) if any(t.loss_mask)]
    if not ppl_convs:
        raise QuantizeError("the held-out split has no conversation with an assistant reply; "
                            "raise data.held_out_fraction")
    metrics: dict[str, Any] = {
        "ppl_target": perplexity(target, ppl_convs), "ppl_w4": perplexity(w4, ppl_convs),
        "ppl_conversations": len(ppl_convs),
    }
    metrics["ppl_ratio"] = metrics["ppl_w4"] / metrics["ppl_target"]

    prompts = [p for p in (chat_prompt_ids(tokenizer, c.messages()[:1]) for c in held_out)
               if len(p) <= settings.max_prompt_len]
    matches: list[bool] = []
    lengths: list[int] = []
    for prompt in tqdm(prompts[: settings.agreement_prompts], desc="greedy agreement", leave=False):
        continuation = greedy_continuation(target, prompt, settings.continuation_tokens, tokenizer.eos_token_id)
        m = teacher_forced_matches(w4, prompt, continuation)
        matches += m
        lengths += acceptance_lengths(m, settings.draft_depth)
    metrics["greedy_agreement"] = sum(matches) / max(len(matches), 1)
    metrics["acceptance_length_m1_m2"] = statistics.mean(lengths) if lengths else float("nan")
    metrics["acceptance_rounds"] = len(lengths)
    metrics["draft_depth"] = settings.draft_depth

    context = [i for t in ppl_convs for i in t.input_ids][: settings.timing_context]
    ms = forward_ms({"target": target, "w4": w4}, context, list(settings.timing_tokens), settings.timing_repeats)
    for name, per in ms.items():
        for n, value in per.items():
            metrics[f"forward_ms_{name}_{n}tok"] = value
    metrics["timing_context"], metrics["timing_tokens"] = len(context), list(settings.timing_tokens)
    return metrics


def report(metrics: dict[str, Any]) -> str:
    m = metrics
    rows = [("held-out perplexity", f"{m['ppl_target']:.3f}", f"{m['ppl_w4']:.3f}",
             f"{100 * (m['ppl_ratio'] - 1):+.1f}%")]
    for k in m["timing_tokens"]:
        target, w4 = m[f"forward_ms_target_{k}tok"], m[f"forward_ms_w4_{k}tok"]
        rows.append((f"forward ms, {k} new token{'s' if k > 1 else ''}", f"{target:.1f}", f"{w4:.1f}",
                     f"{w4 / target:.2f}x"))
    rows.append(("size on disk, MB", f"{m['size_mb_target']:.1f}", f"{m['size_mb_w4']:.1f}",
                 f"{m['size_mb_w4'] / m['size_mb_target']:.2f}x"))
    lines = ([f"{'':26s}{'target':>10s}{'W4':>10s}{'W4/target':>12s}"]
             + [f"{a:26s}{b:>10s}{c:>10s}{d:>12s}" for a, b, c, d in rows])
    lines.append(f"greedy agreement {100 * m['greedy_agreement']:.1f}%  ->  "
                 f"L(M1 <- M2) = {m['acceptance_length_m1_m2']:.2f} tokens/round at draft depth {m['draft_depth']}")
    lines.append(f"quantization wall time {m['quantize_s']:.0f} s; group handling: {m['group_handling']}")
    return "\n".join(lines)
