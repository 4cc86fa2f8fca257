"""Helpers for the tests that quantize a model (tests/quantize, tests/decode's native W4 runner): the tiny random
Llama's tokenizer, the quantize.w4 stage config and the bundled data's settings; the models themselves are fixtures in
tests/conftest.py."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The bundled ShareGPT data as the real-model W4 tests read it: calibration from the train split, held-out text from
# the rest (one setting for both, so the two never overlap).
BUNDLED_DATA = {"source": "bundled", "max_len": 1024, "held_out_fraction": 0.02, "max_conversations": None}


def tiny_tokenizer():
    """A byte-level tokenizer with ChatML markers: offsets and a chat template, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = TEMPLATE
    return fast


def stage_config(source: Path, data: Path, run_dir: Path, **quantize):
    base = OmegaConf.load(REPO / "conf" / "quantize" / "w4.yaml")
    cfg = OmegaConf.create({
        "run_name": "test", "run_dir": str(run_dir), "seed": 0,
        "model": {"name": str(source), "dtype": "float32"},
        "data": {"source": str(data), "max_len": 256, "held_out_fraction": 0.25, "max_conversations": None},
        "wandb": {"mode": "disabled", "project": "polyspec", "entity": None, "group": "test", "dir": str(run_dir)},
        "quantize": base,
    })
    small = {
        "calibration.samples": 8, "calibration.min_len": 32, "calibration.batch_size": 4,
        "eval.ppl_conversations": 4, "eval.agreement_prompts": 2, "eval.continuation_tokens": 16,
        "eval.timing_repeats": 1,
    }
    for key, value in {**small, **quantize}.items():
        OmegaConf.update(cfg, f"quantize.{key}", value)
    return cfg


def held_out_text(tokenizer, conversations: int = 4, tokens: int = 300) -> list:
    """The first held-out ShareGPT conversations of the bundled data, chat-templated as the chains see them, `tokens`
    each, as [1, T] id tensors."""
    import torch

    from data.settings import DataSettings
    from data.sharegpt import load_split, tokenize_conversation

    held_out = load_split(DataSettings(**BUNDLED_DATA))[1][:conversations]
    return [torch.tensor([tokenize_conversation(tokenizer, c, tokens).input_ids]) for c in held_out]
