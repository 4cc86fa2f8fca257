"""`python -m decode.generate prompt="..." chain=NAME`: stream a chat answer through a chain.

Prints the answer as the target commits it, then per-level acceptance and timing, and (compare_ar)
the target decoding alone: the speedup and whether the outputs are identical. `prompt=` and `chain=`
are shorthands for decode.prompt= and decode.chain=; any other Hydra override works as usual.
`prompt=TEXT` takes TEXT literally (`${HOME}`, quotes, a trailing backslash); so does
`decode.prompt_file=PATH` (`-` reads stdin). Bad settings are refused before any model is loaded.
"""
from __future__ import annotations

import re
import sys
from typing import Callable

import hydra
from omegaconf import DictConfig

from decode.chains.build import builder_for, eos_of
from decode.engine.errors import DecodeError
from decode.engine.levels import Generation
from decode.settings import GenerateSettings, generate_of
from infra.cli import run_main
from infra.device import use_threads

def check_context(prompt: list[int], new_tokens: int, model) -> None:
    """Refuse a prompt that, with the tokens to generate, does not fit the model's context."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and len(prompt) + new_tokens > context:
        raise DecodeError(
            f"the prompt is {len(prompt):,} tokens; with decode.max_new_tokens={new_tokens} "
            f"it needs {len(prompt) + new_tokens:,} positions, "
            f"more than the model's context of {context:,} (max_position_embeddings): shorten the prompt"
            + (" or lower decode.max_new_tokens" if len(prompt) < context else ""))


def clipped(show: Callable[[list[int]], None], max_new_tokens: int,
            eos: int | list[int] | None) -> Callable[[list[int]], None]:
    """The chain's committed blocks, passed to `show` cut where its returned tokens end: at max_new_tokens and just
    after the first end-of-sequence token. A block may run past either, and what is printed must be what is checked."""
    stops = set([eos] if isinstance(eos, int) else eos or [])
    left = max_new_tokens

    def stream(tokens: list[int]) -> None:
        nonlocal left
        block = tokens[:left]
        ends = next((i + 1 for i, t in enumerate(block) if t in stops), None)
        block = block[:ends]
        left = 0 if ends else left - len(block)
        if block:
            show(block)

    return stream


def level_table(generation: Generation) -> str:
    rows = [f"{'level':<10} {'kind':<6} {'forwards':>8} {'T_i ms':>8} {'L_i':>6} {'var':>6} {'accepted':>13} "
            f"{'bookkeeping s':>13}"]
    for i, s in enumerate(generation.stats.levels):
        verifies = i < len(generation.stats.levels) - 1
        rows.append(
            f"{s.name:<10} {s.kind:<6} {s.forward_calls:>8} {1000 * s.mean_forward_time_s:>8.1f} "
            f"{(f'{s.mean_acceptance_length:.2f}' if verifies else '-'):>6} "
            f"{(f'{s.acceptance_variance:.2f}' if verifies else '-'):>6} "
            f"{(f'{s.accepted}/{s.proposed}' if verifies else '-'):>13} {s.bookkeeping_time_s:>13.3f}"
        )
    st = generation.stats
    rows.append(f"{st.new_tokens} tokens in {st.wall_time_s:.2f}s = {st.tokens_per_s:.1f} tok/s, "
                f"first token after {st.time_to_first_token_s:.2f}s, draft depth {st.draft_depth:.2f}")
    return "\n".join(rows)


def run(settings: GenerateSettings) -> None:
    from data.sharegpt import chat_prompt_ids
    from decode.chains.baselines import autoregressive
    from decode.chains.build import load_target, refuse_unfit_layers

    decoding, new_tokens = settings.decoding, settings.max_new_tokens
    sampling, name = decoding.sampling, decoding.section.chain
    spec = decoding.spec(name)
    refuse_unfit_layers(spec, f"decode.chains.{name}", decoding.model.name, decoding.layout)  # before any model loads
    use_threads(decoding.section.threads, "decode.threads")
    prepared, tokenizer = load_target(decoding)
    target = prepared.model
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": settings.prompt}])
    check_context(prompt, new_tokens, target)
    chain = builder_for(decoding, prepared, tokenizer).build(spec)
    eos = eos_of(target, tokenizer)
    shown: list[int] = []
    printed = ""

    def stream(tokens: list[int]) -> None:
        nonlocal printed
        shown.extend(tokens)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    result = chain.generate(prompt, new_tokens, sampling, eos_token_id=eos, on_tokens=clipped(stream, new_tokens, eos))
    print(f"\n\nchain {name}: " + " <- ".join(level.name for level in chain.levels))
    print(level_table(result))
    if settings.compare_ar:
        reference = autoregressive(prepared, prompt, new_tokens, sampling, eos_token_id=eos)
        same = reference.tokens == result.tokens
        ratio = (result.stats.tokens_per_s / reference.stats.tokens_per_s if reference.stats.tokens_per_s
                 else float("nan"))
        print(f"target alone: {reference.stats.tokens_per_s:.1f} tok/s; speedup {ratio:.2f}x; "
              f"outputs {'identical' if same else 'differ'}"
              + ("" if same or not sampling.greedy else " (greedy: a near-tie or a bug; decode.eval checks which)")
              + (" (sampling: compare distributions, not single samples)" if not sampling.greedy and not same else ""))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(generate_of(cfg)))


def shorthand(arg: str) -> str:
    """prompt=TEXT -> decode.prompt='...' whose value is TEXT exactly; chain=X -> decode.chain=X.

    TEXT is escaped twice: for OmegaConf, every `${` becomes `\\${` (and the backslashes before it are
    doubled), so it is text, not an interpolation; for Hydra's quoted values, a quote is escaped, and so is
    every backslash right before a quote or at the end. Any text works: commas, quotes, `${HOME}`, a
    trailing backslash."""
    if arg.startswith("prompt="):
        text = arg[len("prompt="):]
        text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
        text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
        text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
        return f"decode.prompt='{text}'"
    return "decode." + arg if arg.startswith("chain=") else arg


def cli() -> None:
    sys.argv = sys.argv[:1] + [shorthand(a) for a in sys.argv[1:]]
    main()


if __name__ == "__main__":
    cli()
