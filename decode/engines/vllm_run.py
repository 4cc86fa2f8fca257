"""One vLLM engine, one job: run by decode.interop with the vLLM venv's python, never imported by polyspec.

    <venv>/bin/python decode/engines/vllm_run.py jobs.json results.json

It imports only vLLM and the standard library (vLLM pins its own torch and transformers, so it lives in its
own venv). The job names the `LLM(...)` keyword arguments, the prompts as token ids (tokenized by polyspec,
so both engines read the same tokens), and what to do: decode them greedily one at a time (single stream,
timed after an untimed warm-up), and optionally score teacher-forced continuations (whether the engine's
argmax is the continuation's next token at each position). The result: tokens, seconds per prompt, load
time, the speculative-decoding counters of `llm.get_metrics()` over the timed decodes, and the matches.
One engine per job, in turn.
"""
from __future__ import annotations

import json
import sys
import time

SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """The speculative-decoding counters so far (absent without speculation), per-position acceptance included."""
    found = {}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            found[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
        elif metric.name == PER_POSITION:
            found["num_accepted_tokens_per_pos"] = list(metric.values)
    return found


def counter_delta(before: dict, after: dict) -> dict:
    delta = {}
    for key, value in after.items():
        old = before.get(key, [0] * len(value) if isinstance(value, list) else 0)
        delta[key] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return delta


def decode(llm, prompts: list, max_tokens: int, warmup_tokens: int) -> dict:
    """Greedy decodes, one prompt per call (single stream); seconds per call; counters over the timed calls."""
    from vllm import SamplingParams, TokensPrompt

    if warmup_tokens:
        llm.generate(TokensPrompt(prompt_token_ids=prompts[0]),
                     SamplingParams(temperature=0.0, max_tokens=warmup_tokens), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before, tokens, seconds = spec_counters(llm), [], []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens.append(list(out[0].outputs[0].token_ids))
    return {"tokens": tokens, "seconds": seconds, "spec": counter_delta(before, spec_counters(llm))}


def teacher_forced(llm, pairs: list) -> list:
    """Per pair [prompt, continuation]: whether the engine's top token at each continuation position is the
    continuation's (rank 1 in the prompt logprobs of prompt + continuation)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    matches = []
    for prompt, continuation in pairs:
        out = llm.generate(TokensPrompt(prompt_token_ids=prompt + continuation), params, use_tqdm=False)[0]
        ranks = out.prompt_logprobs[len(prompt):]
        matches.append([entry[token].rank == 1 for entry, token in zip(ranks, continuation)])
    return matches


def run_job(job: dict) -> dict:
    """One engine: load it (timed), decode and score as the job says, shut it down."""
    import gc

    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**job["llm"], distributed_executor_backend="uni")  # the worker in this process (see main)
    result = {"name": job["name"], "load_s": time.perf_counter() - start}
    try:
        if job.get("prompts"):
            result |= decode(llm, job["prompts"], job["max_tokens"], job.get("warmup_tokens", 0))
        if job.get("teacher_forced"):
            result["teacher_forced"] = teacher_forced(llm, job["teacher_forced"])
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return result


def main(jobs_path: str, results_path: str) -> None:
    """Every job in turn (decode.interop sends one per process and sets VLLM_ENABLE_V1_MULTIPROCESSING=0: one
    vLLM import per engine instead of three, minutes on shared cores). A job that fails is recorded with its
    error and the next one runs; the results file is rewritten after every job, so a crash keeps what finished."""
    import traceback

    results = {}
    for job in json.load(open(jobs_path))["jobs"]:
        print(f"=== vLLM job {job['name']}", flush=True)
        try:
            results[job["name"]] = run_job(job)
        except Exception as err:  # the check reports it: vLLM refusing a checkpoint is a finding, not a crash
            traceback.print_exc()
            results[job["name"]] = {
                "name": job["name"],
                "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300],
            }
        with open(results_path, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":  # vLLM may spawn processes: the LLM must be made under this guard
    main(*sys.argv[1:3])
