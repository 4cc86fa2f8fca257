"""A damaged EAGLE head folder is a one-line HeadError (through a chain, a one-line DecodeError:
tests/decode/test_chain_config.py)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from data.models import weights_hash
from heads.eagle import EagleHead, HeadError


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)).eval()
    out = EagleHead.for_target(target).save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    return target, out


def refused(folder, target, match: str) -> str:
    with pytest.raises(HeadError, match=match) as err:
        EagleHead.from_pretrained(folder, target)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_unreadable_weights_file_is_one_line(saved, damage):
    target, out = saved
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x00" * 64}[damage])
    message = refused(out, target, r"model.safetensors: unreadable \(SafetensorError")
    assert "retrain or restore" in message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(saved, value):
    target, out = saved
    weights = out / "model.safetensors"
    state = load_file(str(weights))
    state["fc.weight"][3, 5] = value
    save_file(state, str(weights))
    refused(out, target, r"non-finite weights in fc.weight")


def test_weights_of_another_shape_are_refused(saved):
    target, out = saved
    weights = out / "model.safetensors"
    state = load_file(str(weights))
    state["fc.weight"] = torch.zeros(3, 3)
    save_file(state, str(weights))
    refused(out, target, r"does not fit this target's head \(.*fc.weight")


@pytest.mark.parametrize("config", [b"", b"\xff\xfe{", b"[" * 100_000, b'{"target": {}}'])
def test_bad_config_json_is_one_line(saved, config):
    target, out = saved
    (out / "config.json").write_bytes(config)
    refused(out, target, r"config.json: not an EAGLE head config")
