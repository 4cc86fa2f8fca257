"""Shared test setup: no W&B network, and the models more than one package's tests use; each test folder's own
fixtures are in its conftest.py."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest
import torch
from clock_fixtures import VirtualClock


DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def distributed_env_as_found():
    """A test training in this process sets torch.distributed's variables (train.eagle.init_distributed) while its
    one-process group keeps listening on MASTER_PORT; a later test's `python -m train.eagle` inheriting them would try
    that port and fail (EADDRINUSE). Each test leaves them as it found them."""
    found = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    yield
    for name, value in found.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def virtual_clock(monkeypatch) -> VirtualClock:
    """The test's own clock in place of the machine's (clock_fixtures.VirtualClock)."""
    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(time, "sleep", clock.sleep)
    return clock


@pytest.fixture(scope="session")
def bundled_target():
    """The real default target (SmolLM2-135M-Instruct, fp32) and its tokenizer, loaded once."""
    from data.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, "float32")


@pytest.fixture(scope="session")
def bundled_w4(tmp_path_factory) -> Path:
    """The real default target through `quantize.w4` with reduced settings (a few minutes on 2 busy cores), once:
    the W4 stage's test reads its report, the native W4 runner's test decodes with it."""
    from data.models import DEFAULT_MODEL
    from quantize.settings import w4_of
    from quantize.w4 import run
    from w4_fixtures import BUNDLED_DATA, stage_config

    run_dir = tmp_path_factory.mktemp("bundled_w4")
    cfg = stage_config(DEFAULT_MODEL, Path("bundled"), run_dir, **{
        "calibration.samples": 8, "calibration.max_len": 128, "calibration.min_len": 64,
        "eval.ppl_conversations": 8, "eval.agreement_prompts": 2, "eval.continuation_tokens": 32,
        "eval.timing_repeats": 3})
    cfg.model.name = DEFAULT_MODEL
    cfg.data = BUNDLED_DATA
    return run(w4_of(cfg))


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
