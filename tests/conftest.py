"""Shared test setup: no W&B network, and the models more than one package's tests use; each test folder's own
fixtures are in its conftest.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch


@pytest.fixture(scope="session")
def bundled_target():
    """The real default target (SmolLM2-135M-Instruct, fp32) and its tokenizer, loaded once."""
    from data.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture
def tiny_llama():
    """A tiny random Llama causal LM (vocab 512) for fast tests; fp32, eval mode, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    """A tiny random Llama folder (hidden 192, MLP 384) with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_source")
    from w4_fixtures import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, initializer_range=0.08,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    words = "the cat sat on a mat while blue dogs ran over green hills and red foxes slept".split()
    records = [
        {"id": f"c{i}", "conversations": [
            {"from": "human", "value": " ".join(words[(i + j) % len(words)] for j in range(12))},
            {"from": "gpt", "value": " ".join(words[(3 * i + j) % len(words)] for j in range(30))},
        ]}
        for i in range(60)
    ]
    path = tmp_path_factory.mktemp("chat") / "chat.json"
    path.write_text(json.dumps(records))
    return path
