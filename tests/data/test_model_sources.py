"""Model specs resolve to loaded models, or fail in one line: bundled GGUF, local folder, hub id."""
from __future__ import annotations

import pytest
import torch

from data.models import ModelSourceError, load_model, resolve_model_path, same_vocabulary, weights_hash
from data.sharegpt import chat_prompt_ids


def test_missing_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(ModelSourceError, match="no such model folder") as err:
        load_model(str(tmp_path / "nope"))
    assert "\n" not in str(err.value)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelSourceError, match="not an HF model folder"):
        resolve_model_path(str(tmp_path))


def test_unknown_bundled_model_is_rejected():
    with pytest.raises(ModelSourceError, match="unknown bundled model"):
        resolve_model_path("bundled:gpt-17")


def test_hub_id_offline_fails_fast_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="hub is unreachable") as err:
        load_model("no-such-org/no-such-model")
    assert "\n" not in str(err.value)


def test_local_folder_round_trip_keeps_weights(tmp_path, tiny_llama, bundled_tokenizer_dir):
    tiny_llama.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bundled_tokenizer_dir / name).read_bytes())
    model, _ = load_model(str(tmp_path))
    assert weights_hash(model) == weights_hash(tiny_llama)


def test_weights_hash_sees_a_single_changed_value(tiny_llama):
    before = weights_hash(tiny_llama)
    with torch.no_grad():
        tiny_llama.model.norm.weight[0] += 1e-3
    assert weights_hash(tiny_llama) != before


@pytest.fixture
def bundled_tokenizer_dir():
    from pathlib import Path

    return Path(resolve_model_path("bundled:smollm2-135m-instruct"))


@pytest.mark.slow
def test_bundled_model_answers_in_english(bundled_target):
    model, tokenizer = bundled_target
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
    text = tokenizer.decode(out, skip_special_tokens=True)
    words = text.split()
    assert "Paris" in text and len(words) >= 5, text
    assert sum(w.strip(".,!?'\"").isalpha() for w in words) / len(words) > 0.8, text


@pytest.mark.slow
def test_same_vocabulary_tells_tokenizers_apart(bundled_target):
    from transformers import AutoTokenizer

    _, tokenizer = bundled_target
    assert same_vocabulary(tokenizer, tokenizer)
    other = AutoTokenizer.from_pretrained(resolve_model_path("bundled:smollm2-135m-instruct"))
    other.add_tokens(["<extra_token_for_test>"])
    assert not same_vocabulary(tokenizer, other)
