"""`python -m decode.costs`: each level's forward time against the tokens it carries (the cost curve).

For the target (plain eager, packed, see decode.fast, and on the native runner), the W4 copy and the EAGLE head of a run
dir (and heads with draft vocabularies of the sizes in `decode.costs.head_vocab`), the median time of
one forward of k = 1, 2, 4, 8, 12, 16 new tokens on top of a KV cache of a real context, all in one
process, interleaved. Every ratio is to the configured target's 1-token forward, the chain's T_1: this
curve is what decides draft lengths, tree sizes and mu, and whether a level pays (Theorem 3.2).
Beside the curve, one greedy decode of `decode.chain` on the same context splits a round's time into each level's
forwards and the round overhead: what a round costs beside forwards (acceptance, drafting logic, cache crops,
Python); and every level's T(1) against its own floor (the bytes its one-token forward streams, counted from the
buffers it runs on, over the read bandwidth a STREAM-style kernel measures in the same process, timed among the
forwards: its median; beside it the floor at that kernel's best read) and its T(k) / T(1); and what every row's
one-token forward launches (CUDA: kernels; a CPU: operators) and how many of those are matrix products.
Writes `decode.costs.out` (json).
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from decode.backends import Backend
from decode.engine.runner import HFHeadRunner, PreparedHead
from decode.engine.spec import LevelSpec
from decode.settings import CostsSettings, Decoding, costs_of
from infra.cli import check_writable, run_main
from infra.device import use_threads
from infra.timing import (Bandwidth, CountedStep, ReadProbe, Step, cached_forward, floors, forward_bytes,
                          interleaved_ms, launches, level_forward, medians, module_bytes, read_bandwidth)


PROBE = "read probe"  # the read probe's row among the timed steps


def head_forward(prepared: PreparedHead, context: list[int], features: torch.Tensor) -> Step:
    """A step: one forward of k new tokens (with k features) of a prepared head's runner after a cached context, its
    logits through the LM head the backend runs it with."""
    runner, head = prepared.new_runner(), prepared.head
    ids = torch.tensor([context], device=features.device)
    with torch.inference_mode():
        runner.forward(ids[:, 1:], features[:, :-1], None, None)
    n = runner.cached()

    def step(k: int) -> object:
        runner.crop(n)
        with torch.inference_mode():
            return head.logits(runner.forward(ids[:, -k:], features[:, -k:], None, None), prepared.lm_head)

    return CountedStep(step, _head_bytes(prepared, runner))


def _head_bytes(prepared: PreparedHead, runner: Any) -> int:
    """The bytes of a head's one-token forward (forward_bytes): fc, its layer and norms (the target's embedding is
    read a row a token) and KV cache; and the LM head its logits run through (the backend's, else its own)."""
    used = prepared.lm_head if prepared.lm_head is not None else prepared.head.lm_head
    return forward_bytes(runner, used, module_bytes(prepared.head, skip=(used,)) + module_bytes(used))


def context_ids(held_out: list, tokenizer, length: int) -> list[int]:
    """`length` tokens of real chat text: held-out ShareGPT conversations, templated, concatenated."""
    from data.sharegpt import tokenize_conversation

    ids: list[int] = []
    for conv in held_out:
        ids += tokenize_conversation(tokenizer, conv, length).input_ids
        if len(ids) >= length:
            return ids[:length]
    return ids


def _w4_steps(w4: Any, context: list[int], steps: dict[str, Step], notes: dict[str, str]) -> None:
    """The prepared W4 level's rows: as it is, and with lm_head: int8 (a CPU kernel), each on its own runner, named
    as the planner looks a level up (LevelSpec.cost_row)."""
    from decode import backends
    from decode.backends.cpu.int8 import Int8RowLinear
    from decode.engine.levels import LevelCompute, ModelLevel

    runner, row = w4.new_runner(), LevelSpec(model="w4").cost_row
    steps[row] = level_forward(ModelLevel("w4", w4, compute=LevelCompute(runner)), context)
    notes[row] = f"{w4.model.name_or_path}, {type(runner).__name__}"
    if backends.on_cpu(w4.model):
        int8 = backends.with_lm_head(w4, Int8RowLinear(w4.model.get_output_embeddings()))
        row = LevelSpec(model="w4", lm_head="int8").cost_row
        steps[row] = level_forward(ModelLevel("w4", int8), context)
        notes[row] = "the W4 level with lm_head: int8"


def _target_steps(decoding: Decoding, context: list[int], steps: dict[str, Step], notes: dict[str, str]) -> Any:
    """The target's rows: as configured (decode.fast, decode.gemm, decode.native_fp32), and beside it the other
    products and forwards it could run on; returns the configured (prepared) target."""
    from data.models import load_model
    from decode import backends
    from decode.backends.cpu.dense import packed_with
    from decode.chains.build import onednn_target
    from decode.engine.levels import ModelLevel

    device, dtype, backend = decoding.device, decoding.model.dtype, decoding.backend
    fast_target = backend.prepare(load_model(decoding.model.name, dtype, device)[0])
    packed = f"{dtype}, packed (decode.fast, {packed_with(fast_target.model)})"
    if backends.runs_natively(fast_target):
        steps["target"] = level_forward(ModelLevel("target", fast_target), context)
        notes["target"] = f"{packed}, native runner (decode.native_fp32)"
        hf_target = Backend(backend.gemm).prepare(load_model(decoding.model.name, dtype, device)[0]).model
        steps["target hf layers"] = cached_forward(hf_target, context)
        notes["target hf layers"] = f"{packed}, the HF layers (decode.native_fp32=off)"
    elif backends.runs_static(fast_target):  # its forwards are the runner's (compiled, graphs on CUDA), not HF's
        steps["target"] = level_forward(ModelLevel("target", fast_target), context)
        notes["target"] = f"{dtype}, {fast_target.new_runner.func.__name__} (decode.backend)"
    else:
        steps["target"], notes["target"] = cached_forward(fast_target.model, context), packed
    onednn = onednn_target(decoding, fast_target.model)  # the other packed product, side by side
    if onednn is not None:
        steps["target onednn"] = cached_forward(onednn, context)
        notes["target onednn"] = f"{dtype}, packed (decode.fast, onednn)"
    return fast_target


def round_costs(settings: CostsSettings, target: Any, tokenizer: Any, prompt: list[int]) -> dict | None:
    """Per round of decode.chain's chain, greedy on `prompt` (decode.costs.round_tokens new tokens, after a short
    warm-up): each level's forward ms, the round's ms and its overhead beside the forwards; None (said on stderr)
    where the chain cannot be built here (a missing artifact)."""
    from decode.chains.build import builder_for
    from decode.engine.errors import DecodeError
    from heads.eagle import HeadError

    decoding = settings.decoding
    name = decoding.section.chain
    try:
        chain = builder_for(decoding, target, tokenizer).build(decoding.spec(name))
    except (DecodeError, HeadError) as err:
        print(f"costs: chain {name!r} unavailable ({err}); no round costs", file=sys.stderr)
        return None
    chain.generate(prompt, 8)
    stats = chain.generate(prompt, settings.section.round_tokens).stats
    rounds = max(len(stats.levels[0].acceptance_lengths), 1)
    forwards = {level.name: (level.draft_time_s + level.verify_time_s) * 1000 / rounds for level in stats.levels}
    round_ms = (stats.wall_time_s - stats.time_to_first_token_s) * 1000 / rounds
    return {"chain": name, "rounds": rounds, "tokens_per_round": stats.new_tokens / rounds, "round_ms": round_ms,
            "forward_ms": forwards, "overhead_ms": stats.beside_forwards_s * 1000 / rounds}


def steps_for(settings: CostsSettings) -> tuple[dict[str, Step], dict[str, str], dict]:
    """The forwards to time, a note per row on what it is, and what is measured beside them: the configured target's
    weight-streaming floor and the round costs of decode.chain."""
    from data.models import load_model
    from data.sharegpt import load_split

    decoding = settings.decoding
    device, backend = decoding.device, decoding.backend
    # the data before any model or kernel build: refused in seconds
    _, held_out = load_split(settings.data)
    target, tokenizer = load_model(decoding.model.name, decoding.model.dtype, device)
    context = context_ids(held_out, tokenizer, settings.section.context)
    steps = {"target eager": cached_forward(target, context)}
    notes = {"target eager": f"{decoding.model.dtype}, plain nn.Linear"}
    fast_target = _target_steps(decoding, context, steps, notes)
    beside = {"bandwidth": _best_bandwidth(), "round": round_costs(settings, fast_target, tokenizer, context)}
    w4, w4_dir = None, decoding.layout.output("w4")
    if (w4_dir / "config.json").is_file():
        w4 = backend.drafting(fast_target).prepare(backend.load(str(w4_dir), decoding.model.dtype, device)[0])
        _w4_steps(w4, context, steps, notes)
    else:
        print(f"costs: no W4 model in {w4_dir}; skipping it", file=sys.stderr)
    _small_page_steps(decoding, fast_target, context, (steps, notes))
    with torch.inference_mode():
        states = target(torch.tensor([context], device=device), output_hidden_states=True).hidden_states
    vocab = _head_steps(settings, (fast_target, tokenizer), (context, states), (steps, notes))
    if w4 is not None and vocab is not None:
        from heads.eagle import vocabulary_rows
        from decode.engine.levels import LevelCompute, ModelLevel

        rows = backend.linear(w4.model, vocabulary_rows(w4.lm_head, vocab))
        row = LevelSpec(model="w4", vocab="head").cost_row
        steps[row] = level_forward(ModelLevel("w4", w4, vocab=vocab, compute=LevelCompute(lm_head=rows)), context)
        notes[row] = f"the W4 level restricted to the head's {len(vocab)}-token vocabulary (vocab: head)"
    return steps, notes, beside


def _small_page_steps(decoding: Decoding, fast_target: Any, context: list[int], rows: tuple) -> None:
    """Beside the target and the W4 level (its int8 LM head, as the chains run it), each built again with its packed
    weights on 4 KiB pages (infra.hugepages.small_pages): what the huge pages gain, in the same process; only where
    the system offers them (`rows`: the steps and notes to add to)."""
    from data.models import load_model
    from decode import backends
    from decode.backends.cpu.int8 import Int8RowLinear
    from decode.engine.levels import ModelLevel
    from infra import hugepages

    (steps, notes), model, w4_dir = rows, decoding.model, decoding.layout.output("w4")
    if not hugepages.available() or not backends.runs_natively(fast_target):
        return
    with hugepages.small_pages():
        target = decoding.backend.prepare(load_model(model.name, model.dtype, decoding.device)[0])
        steps["target 4KiB pages"] = level_forward(ModelLevel("target", target), context)
        notes["target 4KiB pages"] = "the target (default) with its packed weights on 4 KiB pages"
        if (w4_dir / "config.json").is_file():
            w4 = decoding.backend.drafting(target).prepare(
                decoding.backend.load(str(w4_dir), model.dtype, decoding.device)[0])
            int8 = backends.with_lm_head(w4, Int8RowLinear(w4.model.get_output_embeddings()))
            steps["w4 int8 head 4KiB"] = level_forward(ModelLevel("w4", int8), context)
            notes["w4 int8 head 4KiB"] = "the W4 level with lm_head: int8, its packed weights on 4 KiB pages"


def _head_steps(settings: CostsSettings, target: tuple, inputs: tuple, rows: tuple) -> torch.Tensor | None:
    """The rows of the run's head (either method) and of untrained heads with `decode.costs.head_vocab`'s draft
    vocabularies, each as a chain's drafter runs on the run's backend (`target`: the prepared target and tokenizer;
    `inputs`: the context and the target's hidden states on it; `rows`: the steps and notes to add to); returns the
    run's head's draft vocabulary, if any."""
    from heads.eagle import EagleHead
    from heads.eagle3 import load_head

    (prepared_target, tokenizer), (context, states), (steps, notes) = target, inputs, rows
    model, backend = prepared_target.model, settings.decoding.backend.drafting(prepared_target)
    head_dir, heads = settings.decoding.layout.output("eagle"), {}
    if (head_dir / "config.json").is_file():
        heads["head"] = load_head(head_dir, model, tokenizer)
        n = heads["head"].draft_vocab
        notes["head"] = f"{head_dir}, draft vocabulary {'full' if n is None else len(n)}"
    for size in settings.section.head_vocab:
        vocab = None if size is None else torch.arange(int(size))  # cost depends on the size only
        heads[f"head V={size or 'full'}"] = EagleHead.for_target(model, draft_vocab=vocab)
        notes[f"head V={size or 'full'}"] = "untrained head, timing only"
    for name, head in heads.items():
        prepared = backend.prepare_head(head.eval())
        layers = getattr(head, "aux_layers", None)  # an EAGLE-3 head drafts from the aux states first
        features = torch.cat([states[i] for i in layers], -1) if layers else states[-1]
        steps[name] = head_forward(prepared, context, features)
        runner = getattr(prepared.new_runner, "func", prepared.new_runner)
        notes[name] += f", {runner.__name__}"
        if name == "head" and runner is not HFHeadRunner:  # beside it, the head's own forward
            own = dataclasses.replace(prepared, new_runner=functools.partial(HFHeadRunner, prepared.head))
            steps["head hf layer"] = head_forward(own, context, features)
            notes["head hf layer"] = "the run's head on its own forward (decode.native_fp32=off)"
            int8 = backend.prepare_head(head, "int8")  # the native runner again, on int8 rows
            steps["head int8"] = head_forward(int8, context, features)
            notes["head int8"] = "the run's head on int8 rows (weights: int8, as the configured chains run it)"
    return heads["head"].draft_vocab if "head" in heads else None


@functools.cache
def _stream() -> tuple:
    """The C++ STREAM-style read kernel and its name, else (None, why not), said once: torch's sum measures instead."""
    from decode.backends.cpu.llama import stream_kernel

    kernel, name = stream_kernel()
    if kernel is None:
        print(f"costs: no read-bandwidth kernel ({name}); measuring with torch's sum", file=sys.stderr)
    return kernel, name


def _best_bandwidth() -> Bandwidth:
    """The read bandwidth of this process's threads at its best (STREAM's best of 7), apart from the forwards."""
    return read_bandwidth(stream=_stream())


def _print_floors(ms: dict, steps: dict[str, Step], probed: tuple[Bandwidth, dict[str, float]],
                  best: Bandwidth) -> dict:
    """Each row's T(1) against its floor and its T(k) / T(1), one line a row; returns the rows (`floors`). `probed`:
    the read timed among the forwards and each row's T(1)/floor paired repeat by repeat with it (ReadProbe); beside
    it T(1) against the floor at the best read of `best` and of a second measurement now (on shared cores one may
    land in a busy moment), the lowest floor seen."""
    read, paired = probed
    after = _best_bandwidth()
    best = Bandwidth(max(best.bytes_per_s, after.bytes_per_s), f"{after.method}, before and after the timings")
    rows, at_best = floors(ms, steps, read), floors(ms, steps, best)
    print(f"\neach row's floor: the bytes its one-token forward streams / {read.bytes_per_s / 1e9:.1f} GB/s read "
          f"({read.method}); at best {best.bytes_per_s / 1e9:.1f} GB/s ({best.method})")
    for name, row in rows.items():
        row["ratio"] = paired[name]
        row["at_best_read"] = {"ms": at_best[name]["ms"], "ratio": at_best[name]["ratio"], "method": best.method,
                               "read_bytes_per_s": best.bytes_per_s}
        ratios = " ".join(f"k={k} {r:.2f}" for k, r in sorted(row["t_k_over_t_1"].items()))
        print(f"{name:<18}{row['bytes'] / 2**20:8.1f} MiB  floor {row['ms']:6.2f} ms  T(1)/floor {row['ratio']:5.2f}"
              f" (at best {row['at_best_read']['ratio']:4.2f})  T(k)/T(1) {ratios}")
    return rows


def _print_launches(steps: dict[str, Step], device: Any) -> dict[str, dict[str, int]]:
    """Each row's launches of a one-token forward (infra.timing.launches), one line a row; returns them."""
    counts = {name: launches(step, device) for name, step in steps.items()}
    what = ("device kernels and copies" if torch.device(device).type == "cuda"
            else "operators dispatched and a compiled graph's kernels")
    print(f"\nlaunches of a one-token forward, by torch.profiler: {what}; matrix products among them")
    for name, count in counts.items():
        print(f"{name:<18}{count['kernels']:6d} launches  {count['products']:5d} products")
    return counts


def _print_rounds(rounds: dict) -> None:
    """One line: a round's ms, split into each level's forwards and the overhead beside them."""
    forwards = ", ".join(f"{name} {ms:.1f}" for name, ms in rounds["forward_ms"].items())
    print(f"a round of chain {rounds['chain']!r} ({rounds['rounds']} rounds, {rounds['tokens_per_round']:.2f} tokens "
          f"each): {rounds['round_ms']:.1f} ms = forwards ({forwards}) + overhead {rounds['overhead_ms']:.1f} ms")


def run(settings: CostsSettings) -> dict:
    from infra.tracking import write_json_atomic

    c = settings.section
    check_writable(c.out, "decode.costs.out", kind="file")  # refuse before minutes of timing, not after
    use_threads(settings.decoding.section.threads, "decode.threads")
    steps, notes, beside = steps_for(settings)
    ks, probe = list(c.ks), ReadProbe(_stream())
    times = interleaved_ms(steps | {PROBE: probe}, ks, c.repeats)
    ms = medians(times)
    probed = probe.bandwidth(ms.pop(PROBE)), probe.paired_ratios(times, steps, PROBE)
    base = ms["target"][1]
    print(f"\nmedian ms per forward of k new tokens on a {c.context}-token context, {c.repeats} repeats interleaved, "
          f"{torch.get_num_threads()} threads; (x) = ratio to the configured target's 1-token forward")
    print(f"{'level':<18}" + "".join(f"{f'k={k}':>15}" for k in ks) + "  note")
    for name, per in ms.items():
        print(f"{name:<18}" + "".join(f"{per[k]:8.1f} ({per[k] / base:4.2f})" for k in ks) + f"  {notes[name]}")
    result = {"device": str(settings.decoding.device), "context": c.context, "threads": torch.get_num_threads(),
              "repeats": c.repeats, "notes": notes, "ms": ms,
              "ratio_to_target_1": {n: {k: v / base for k, v in per.items()} for n, per in ms.items()}}
    result["floors"] = _print_floors(ms, steps, probed, beside["bandwidth"])
    result["launches"] = _print_launches(steps, settings.decoding.device)
    target = result["floors"]["target"]
    result["floor"] = {"ms": target["ms"], "weight_bytes": target["bytes"], "ratio": target["ratio"],
                       "read_bytes_per_s": target["read_bytes_per_s"], "method": target["method"]}
    if beside["round"] is not None:
        _print_rounds(beside["round"])
        result["round"] = beside["round"]
    write_json_atomic(c.out, result)
    print(f"written {c.out}")
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: run(costs_of(cfg)))


if __name__ == "__main__":
    main()
