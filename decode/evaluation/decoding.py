"""Decoding for the eval: every question with every method, interleaved after a warm-up (records per turn), the
sampled decodes of Theorem 3.3, and the planned chains (decode.chains.plan) decoded next to the configured ones."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tqdm import tqdm

from decode.engine.sampling import GREEDY, Sampling
from decode.evaluation import EvalError

if TYPE_CHECKING:
    from decode.settings import EvalSettings

Decoder = Callable[..., Any]  # (prompt_ids, max_new_tokens, sampling=GREEDY) -> Generation


@dataclass
class Record:
    """One decoded turn of one method: what it produced and what the engine measured."""

    question_id: Any
    category: str
    turn: int
    prompt_ids: list[int]
    tokens: list[int]
    stats: Any  # decode.chain.GenerationStats

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.stats.wall_time_s if self.stats.wall_time_s > 0 else 0.0


def _record(question, turn: int, prompt_ids: list[int], generation) -> Record:
    return Record(question.question_id, question.category, turn, list(prompt_ids), list(generation.tokens),
                  generation.stats)


def decode_questions(
    decoders: dict[str, Decoder], questions: list, tokenizer, max_new_tokens: int, warmup_tokens: int,
    reference: str = "ar",
) -> dict[str, list[Record]]:
    """Decode every turn of every question with every decoder, interleaved so CPU noise hits all alike, in an
    order rotated from turn to turn (as decode.bench does): no method always runs first, on a cooler cache."""
    from data.sharegpt import chat_prompt_ids

    if reference not in decoders:
        raise EvalError(f"the reference decoder {reference!r} is missing")
    first = chat_prompt_ids(tokenizer, [{"role": "user", "content": questions[0].turns[0]}])
    for decode in decoders.values():
        decode(first, warmup_tokens)
    records: dict[str, list[Record]] = {name: [] for name in decoders}
    names, step = list(decoders), 0
    progress = tqdm(questions, desc="eval", unit="question", file=sys.stderr)
    for question in progress:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(question.turns):
            messages.append({"role": "user", "content": text})
            prompt_ids = chat_prompt_ids(tokenizer, messages)
            for name in names[step % len(names):] + names[: step % len(names)]:  # no method always runs first
                records[name].append(_record(question, turn, prompt_ids, decoders[name](prompt_ids, max_new_tokens)))
            step += 1
            answer = tokenizer.decode(records[reference][-1].tokens, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        progress.set_postfix({n: f"{r[-1].tokens_per_s:.1f}tok/s" for n, r in records.items()})
    return records


def decode_sampled(decoders: dict[str, Decoder], questions: list, tokenizer, max_new_tokens: int, temperature: float,
                   seed: int) -> dict[str, list[Record]]:
    """First turns decoded by sampling (Theorem 3.3's side of the comparison; the greedy side is the main run)."""
    from data.sharegpt import chat_prompt_ids

    records: dict[str, list[Record]] = {name: [] for name in decoders}
    for i, question in enumerate(questions):
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": question.turns[0]}])
        for name, decode in decoders.items():
            generation = decode(prompt_ids, max_new_tokens, Sampling(temperature, seed=seed + i))
            records[name].append(_record(question, 0, prompt_ids, generation))
    return records


@dataclass
class Decoded:
    """What the eval decoded: each method's per-turn records, each chain's levels (as its spec writes them: planned
    chains included), the plans, the sampled decodes (Theorem 3.3), and how many questions."""

    records: dict[str, list[Record]]
    chains: dict[str, list[dict[str, Any]]]
    questions: int
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    sampled: dict[str, list[Record]] = field(default_factory=dict)

    @property
    def names(self) -> dict[str, list[str]]:
        """Each chain's level names, target first."""
        return {chain: [level["name"] for level in levels] for chain, levels in self.chains.items()}


def chain_decoder(chain, eos: Any) -> Decoder:
    def decode(prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = GREEDY):
        return chain.generate(prompt_ids, max_new_tokens, sampling, eos_token_id=eos)

    return decode


def build_decoders(settings: EvalSettings, builder: Any, eos: Any) -> dict[str, Decoder]:
    """The AR reference and every chain the eval compares, as decoders."""
    from decode.chains.build import reference_decoders

    decoders: dict[str, Decoder] = reference_decoders(settings.decoding, builder.prepared_target, eos)
    for name, spec in settings.specs.items():
        decoders[name] = chain_decoder(builder.build(spec), eos)
    return decoders


def calibration_prompts(prompts_file: str | None, count: int, questions: list, tokenizer) -> list[list[int]]:
    """First turns of questions the eval does not decode (categories in turn), else of the eval's own."""
    from data.prompts import load_questions
    from data.sharegpt import chat_prompt_ids

    used = {q.question_id for q in questions}
    held_out = [q for q in load_questions(prompts_file) if q.question_id not in used] or questions
    seen: dict[str, int] = {}
    ranked = []
    for q in held_out:
        seen[q.category] = seen.get(q.category, 0) + 1
        ranked.append((seen[q.category], q))
    picked = [q for _, q in sorted(ranked, key=lambda r: r[0])][:count]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in picked]


def plan_chains(settings: EvalSettings, builder: Any, decoders: dict[str, Decoder], questions: list,
                eos: Any) -> dict[str, dict[str, Any]]:
    """Plan the chains of eval.plan.chains (null: all) and every other stack their levels allow
    (decode.engine.spec.stacks) on held-out prompts, calibrated together (decode.chains.plan.plan_chains). A plan that
    changes a chain's knobs adds the decoder `<chain>_planned` (a chain built from the planned spec), decoded next to
    the configured chain; the eval.plan.stacks stacks predicted fastest are decoded at their planned knobs. A plan's
    `decoded` names the sides the eval decodes."""
    from decode.chains.plan import plan_chains as plan_specs
    from decode.engine.spec import stacks

    specs, plan_settings = settings.specs, settings.plan
    names = plan_settings.chains or list(specs)
    for name in names:
        if name not in specs:
            raise EvalError(f"eval.plan.chains: {name!r} is not one of eval.chains ({', '.join(specs)})")
    searched = {name: settings.decoding.parse_chain(levels, f"stack {name}")
                for name, levels in (stacks(specs[n] for n in names).items() if plan_settings.stacks else ())}
    prompts = calibration_prompts(settings.section.prompts, plan_settings.questions, questions, builder.tokenizer)
    turn_tokens = max(settings.section.max_new_tokens - 1, 1)  # a turn's tokens after its first (decoding time's)
    print(f"plan: calibrating {len(names) + len(searched)} chains on {len(prompts)} held-out prompts, interleaved",
          file=sys.stderr)
    plans = plan_specs({n: specs[n] for n in names} | searched, builder.build, prompts, plan_settings, eos, turn_tokens)
    for name in names:
        planned_spec = specs[name].with_knobs(plans[name]["planned"]["knobs"])
        chain = name if planned_spec == specs[name] else f"{name}_planned"
        if chain != name:
            decoders[chain] = chain_decoder(builder.build(planned_spec), eos)
        plans[name] |= {"chain": chain, "levels": planned_spec.as_config(), "decoded": ["configured", "planned"]}
    planned_stacks = {name: spec.with_knobs(plans[name]["planned"]["knobs"]) for name, spec in searched.items()}
    for name, planned_spec in planned_stacks.items():
        del plans[name]["configured"]  # a stack has no configured knobs, only the planner's
        plans[name] |= {"chain": name, "levels": planned_spec.as_config(), "decoded": [], "stack": True}
    fastest = sorted(searched, key=lambda n: plans[n]["planned"]["predicted"]["s_per_token"])
    for name in fastest[: plan_settings.stacks]:
        decoders[name] = chain_decoder(builder.build(planned_stacks[name]), eos)
        plans[name]["decoded"] = ["planned"]
    return plans
