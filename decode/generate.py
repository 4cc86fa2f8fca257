"""`python -m decode.generate prompt="..." chain=NAME`: stream a chat answer through a chain.

Prints the answer as the target commits it, then per-level acceptance and timing, and (compare_ar)
the target decoding alone: the speedup and whether the outputs are identical. `prompt=` and `chain=`
are shorthands for decode.prompt= and decode.chain=; any other Hydra override works as usual.
"""
from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from data.cli import run_or_exit
from decode.chain import Chain, DecodeError, Generation, build_chain


def chain_from_config(cfg: DictConfig, name: str, target, tokenizer) -> Chain:
    chains = cfg.decode.chains
    if name not in chains or chains[name] is None:
        raise DecodeError(f"decode.chain={name!r}: no such chain in conf/decode/chain.yaml; known: {', '.join(chains)}")
    levels = OmegaConf.to_container(chains[name], resolve=True)
    return build_chain(levels, target, tokenizer, run_dir=cfg.run_dir, dtype=cfg.model.dtype, fast=bool(cfg.decode.get("fast")))


def sampling_args(cfg: DictConfig) -> dict:
    d = cfg.decode
    return {"temperature": float(d.temperature), "top_k": int(d.top_k), "top_p": float(d.top_p), "seed": d.seed}


def level_table(generation: Generation) -> str:
    rows = [f"{'level':<10} {'kind':<6} {'forwards':>8} {'T_i ms':>8} {'L_i':>6} {'var':>6} {'accepted':>13} {'bookkeeping s':>13}"]
    for i, s in enumerate(generation.stats.levels):
        verifies = i < len(generation.stats.levels) - 1
        rows.append(
            f"{s.name:<10} {s.kind:<6} {s.forward_calls:>8} {1000 * s.mean_forward_time_s:>8.1f} "
            f"{(f'{s.mean_acceptance_length:.2f}' if verifies else '-'):>6} {(f'{s.acceptance_variance:.2f}' if verifies else '-'):>6} "
            f"{(f'{s.accepted}/{s.proposed}' if verifies else '-'):>13} {s.bookkeeping_time_s:>13.3f}"
        )
    st = generation.stats
    rows.append(f"{st.new_tokens} tokens in {st.wall_time_s:.2f}s = {st.tokens_per_s:.1f} tok/s, "
                f"first token after {st.time_to_first_token_s:.2f}s, draft depth {st.draft_depth:.2f}")
    return "\n".join(rows)


def run(cfg: DictConfig) -> None:
    from data.sharegpt import chat_prompt_ids
    from decode.baselines import autoregressive
    from decode.chain import load_target

    d = cfg.decode
    if not d.prompt:
        raise DecodeError('no prompt: python -m decode.generate prompt="your question"')
    if d.get("threads"):
        torch.set_num_threads(int(d.threads))
    target, tokenizer = load_target(cfg)
    chain = chain_from_config(cfg, d.chain, target, tokenizer)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": str(d.prompt)}])
    eos = tokenizer.eos_token_id
    shown: list[int] = []
    printed = ""

    def stream(tokens: list[int]) -> None:
        nonlocal printed
        shown.extend(tokens)
        text = tokenizer.decode(shown, skip_special_tokens=True)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text

    result = chain.generate(prompt, int(d.max_new_tokens), eos_token_id=eos, on_tokens=stream, **sampling_args(cfg))
    print(f"\n\nchain {d.chain}: " + " <- ".join(level.name for level in chain.levels))
    print(level_table(result))
    if d.compare_ar:
        reference = autoregressive(target, prompt, int(d.max_new_tokens), eos_token_id=eos, **sampling_args(cfg))
        same = reference.tokens == result.tokens
        print(f"target alone: {reference.stats.tokens_per_s:.1f} tok/s; speedup {result.stats.tokens_per_s / reference.stats.tokens_per_s:.2f}x; "
              f"outputs {'identical' if same else 'differ'}"
              + ("" if same or float(d.temperature) > 0 else " (greedy: a near-tie or a bug; decode.eval checks which)")
              + (" (sampling: compare distributions, not single samples)" if float(d.temperature) > 0 and not same else ""))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from data.models import ModelSourceError
    from data.sharegpt import DataError
    from decode.head import HeadError

    run_or_exit(run, cfg, errors=(DecodeError, ModelSourceError, DataError, HeadError))


def shorthand(arg: str) -> str:
    """prompt=TEXT -> decode.prompt='TEXT' (quoted: any text, commas included); chain=X -> decode.chain=X."""
    if arg.startswith("prompt="):
        text = arg[len("prompt="):].replace("'", "\\'")
        return f"decode.prompt='{text}'"
    return "decode." + arg if arg.startswith("chain=") else arg


def cli() -> None:
    sys.argv = sys.argv[:1] + [shorthand(a) for a in sys.argv[1:]]
    main()


if __name__ == "__main__":
    cli()
