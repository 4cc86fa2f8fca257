"""Shared test setup: no W&B network, a `slow` marker, and small fixtures every stage's tests use."""
from __future__ import annotations

import json
import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run ~8x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture
def sharegpt_file(tmp_path):
    """A small ShareGPT-format JSON file with valid conversations only."""
    records = [
        {"id": f"conv{i}", "conversations": [
            {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."},
            {"from": "human", "value": "Thanks! And times two?"},
            {"from": "gpt", "value": f"That is {4 * i}."},
        ]}
        for i in range(40)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path
