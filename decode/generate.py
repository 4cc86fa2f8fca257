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
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from decode.chains.build import chain_from_config, configured_builder, eos_of, sampling_of
from decode.engine.chain import check_new_tokens
from decode.engine.errors import DecodeError
from decode.engine.levels import Generation
from infra.cli import flag, run_main
from infra.device import use_threads

_SURROGATE = re.compile("[\ud800-\udfff]")


def max_new_tokens(cfg: DictConfig) -> int:
    value = cfg.decode.get("max_new_tokens")
    try:
        check_new_tokens(value)
    except DecodeError as err:
        raise DecodeError(f"decode.{err}") from None
    return int(value)


def prompt_text(cfg: DictConfig) -> str:
    """The user message: the file `decode.prompt_file` read literally (`-` = stdin; UTF-8, a byte order mark
    and one final newline dropped), or `decode.prompt` (the `prompt=` shorthand makes that literal too;
    a plain `decode.prompt=` override is Hydra syntax, where `${...}` is an interpolation)."""
    try:
        prompt, prompt_file = cfg.decode.get("prompt"), cfg.decode.get("prompt_file")
    except OmegaConfBaseException as err:
        raise DecodeError(f"decode.prompt: cannot resolve it ({err.__class__.__name__}); pass text with prompt=\"...\" "
                          "or decode.prompt_file=PATH, which are taken literally") from None
    if prompt is not None and prompt_file is not None:
        raise DecodeError("decode.prompt and decode.prompt_file are both set; give one")
    if prompt_file is not None:
        where = "decode.prompt_file=-" if str(prompt_file) == "-" else f"decode.prompt_file={prompt_file}"
        try:
            data = (sys.stdin.buffer.read() if str(prompt_file) == "-"
                    else Path(str(prompt_file)).expanduser().read_bytes())
        except OSError as err:
            raise DecodeError(f"{where}: cannot read ({err.strerror or err.__class__.__name__})") from None
        try:
            prompt = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        except UnicodeDecodeError as err:
            raise DecodeError(f"{where}: not UTF-8 text (byte {err.start + 1})") from None
        prompt = prompt[:-2] if prompt.endswith("\r\n") else prompt[:-1] if prompt.endswith("\n") else prompt
    else:
        where = "decode.prompt"
    if prompt_file is not None and not prompt.strip():
        raise DecodeError(f"{where}: no prompt in it (empty)")
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        raise DecodeError('no prompt: python -m decode.generate prompt="your question"')
    if not isinstance(prompt, (str, int, float)) or isinstance(prompt, bool):
        raise DecodeError(f"decode.prompt must be text, got {type(prompt).__name__}; quote it: prompt=\"...\"")
    prompt = str(prompt)
    if _SURROGATE.search(prompt):
        raise DecodeError(f"{where}: not valid UTF-8 text (undecodable bytes or lone surrogates)")
    return prompt


def check_context(prompt: list[int], new_tokens: int, model) -> None:
    """Refuse a prompt that, with the tokens to generate, does not fit the model's context."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and len(prompt) + new_tokens > context:
        raise DecodeError(
            f"the prompt is {len(prompt):,} tokens; with decode.max_new_tokens={new_tokens} "
            f"it needs {len(prompt) + new_tokens:,} positions, "
            f"more than the model's context of {context:,} (max_position_embeddings): shorten the prompt"
            + (" or lower decode.max_new_tokens" if len(prompt) < context else ""))


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


def run(cfg: DictConfig) -> None:
    from data.sharegpt import chat_prompt_ids
    from decode.chains.baselines import autoregressive
    from decode.chains.build import load_target

    d = cfg.decode
    text, new_tokens, sampling = prompt_text(cfg), max_new_tokens(cfg), sampling_of(cfg)  # checked before any loading
    flag(d, "fast", default=False, error=DecodeError)
    compare_ar = flag(d, "compare_ar", default=False, error=DecodeError)
    use_threads(d.get("threads"), "decode.threads")
    prepared, tokenizer = load_target(cfg)
    target = prepared.model
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    check_context(prompt, new_tokens, target)
    chain = chain_from_config(cfg, d.chain, configured_builder(cfg, prepared, tokenizer))
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

    result = chain.generate(prompt, new_tokens, sampling, eos_token_id=eos, on_tokens=stream)
    print(f"\n\nchain {d.chain}: " + " <- ".join(level.name for level in chain.levels))
    print(level_table(result))
    if compare_ar:
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
    run_main(lambda: run(cfg))


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
