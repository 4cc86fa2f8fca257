"""llama.cpp's plain decoding of the F32 target alone, in a process of its own: the check that decode.bench's
llama.cpp phase measures llama.cpp as it runs alone, on equal terms. Same prompts as the bench (the first turn of each
category's first questions), same tool (llama-speculative-simple drafting nothing), same threads.

    python -m benchmarks.llamacpp_alone [--per-category 1] [--new-tokens 64] [--threads 2]

Prints the median tokens/s over the prompts (as the bench's llamacpp_ar row) and each prompt's. Needs the project's
llama.cpp build (decode.bench decode.bench.llamacpp.enabled=true builds it once)."""
from __future__ import annotations

import argparse
import statistics

from data.models import DEFAULT_MODEL, load_tokenizer
from data.prompts import load_questions
from data.sharegpt import chat_prompt_ids
from decode.engines.llamacpp import decode, ensure_built, target_gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    texts = [tokenizer.decode(chat_prompt_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]),
                              skip_special_tokens=False) for q in load_questions(None, per_category=args.per_category)]
    tools, target = ensure_built(), target_gguf(DEFAULT_MODEL.removeprefix("bundled:"))
    decode(tools, target, texts[0], 8, args.threads)  # warm-up, as the bench's
    speeds = [decode(tools, target, text, args.new_tokens, args.threads).tokens_per_s for text in texts]
    print(f"llama.cpp AR alone, {target.name}, {args.threads} threads, {len(texts)} prompts x {args.new_tokens} "
          f"tokens: median {statistics.median(speeds):.2f} tok/s; per prompt {', '.join(f'{s:.1f}' for s in speeds)}")


if __name__ == "__main__":
    main()
