"""`python -m data.prepare`: convert the target, load and tokenize ShareGPT, print what there is.

The first thing a new machine runs: it warms the model cache and shows the data is usable.
"""
from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from data.models import load_model
from data.prompts import load_questions
from data.settings import PrepareSettings, prepare_of
from data.sharegpt import chat_prompt_ids, load_split, load_tokenized
from infra.cli import run_main


def prepare(settings: PrepareSettings) -> dict[str, int]:
    split = load_split(settings.data)  # inputs first: a bad file is refused before the model loads
    questions = load_questions(settings.prompts)
    model, tokenizer = load_model(settings.model.name, settings.model.dtype)
    train, held_out = load_tokenized(settings.data, tokenizer, split)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": questions[0].turns[0]}])
    reply = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):]
    counts = {
        "train_conversations": len(train),
        "held_out_conversations": len(held_out),
        "train_tokens": sum(len(t.input_ids) for t in train),
        "train_assistant_tokens": sum(sum(t.loss_mask) for t in train),
        "questions": len(questions),
    }
    for k, v in counts.items():
        print(f"{k:>24}: {v}")
    print(f"{'sample reply':>24}: {tokenizer.decode(reply, skip_special_tokens=True)!r}")
    return counts


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_main(lambda: prepare(prepare_of(cfg)))


if __name__ == "__main__":
    main()
