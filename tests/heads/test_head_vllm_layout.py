"""The head is vLLM's EAGLE-1/2 function, saved in the layout vLLM loads; old-format heads are refused."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from data.models import weights_hash
from heads.eagle import FORMAT_VERSION, EagleHead, HeadError

H, INTER, HEADS, KV, V = 64, 128, 4, 2, 300

VLLM_SHAPES = {  # vLLM's llama_eagle names: fc without bias, layer 0 without input_layernorm, no final norm
    "fc.weight": (H, 2 * H),
    "layers.0.self_attn.q_proj.weight": (H, H),
    "layers.0.self_attn.k_proj.weight": (H // HEADS * KV, H),
    "layers.0.self_attn.v_proj.weight": (H // HEADS * KV, H),
    "layers.0.self_attn.o_proj.weight": (H, H),
    "layers.0.post_attention_layernorm.weight": (H,),
    "layers.0.mlp.gate_proj.weight": (INTER, H),
    "layers.0.mlp.up_proj.weight": (INTER, H),
    "layers.0.mlp.down_proj.weight": (H, INTER),
}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV, max_position_embeddings=256, tie_word_embeddings=True)).eval()


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    freqs = positions[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def by_hand(w: dict[str, torch.Tensor], embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor,
            feats: torch.Tensor, cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM llama_eagle from the saved tensors: fc(cat[embed, h]) -> attention (no input norm) + residual ->
    post-attention norm -> MLP + residual -> no final norm -> LM head."""
    x = torch.cat([embed[ids], feats], -1) @ w["fc.weight"].T
    T, d = x.shape[0], H // HEADS
    q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(T, HEADS, d).transpose(0, 1)
    k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(T, KV, d).transpose(0, 1)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(T, KV, d).transpose(0, 1)
    positions = torch.arange(T)
    q, k = (rotate(q, positions, cfg.rope_parameters["rope_theta"]),
            rotate(k, positions, cfg.rope_parameters["rope_theta"]))
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, H)
    residual = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
    y = rms(residual, w["layers.0.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = ((F.silu(y @ w["layers.0.mlp.gate_proj.weight"].T) * (y @ w["layers.0.mlp.up_proj.weight"].T))
           @ w["layers.0.mlp.down_proj.weight"].T)
    hidden = mlp + residual
    return hidden, hidden @ lm_head.T


def test_head_computes_vllms_function_from_its_saved_weights(tmp_path):
    target = tiny_llama()
    head = EagleHead(target, init_std=0.2).eval()
    with torch.no_grad():
        head.layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    out = head.save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    w = load_file(str(out / "model.safetensors"))
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(1))
    feats = torch.randn(12, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden, logits, _ = head(ids[None], feats[None])
        want_hidden, want_logits = by_hand(w, target.model.embed_tokens.weight, target.lm_head.weight, ids, feats,
                                           target.config)
    torch.testing.assert_close(hidden[0], want_hidden, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits[0], want_logits, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(hidden[0], target.model.norm(want_hidden), atol=1e-3)  # no final norm on the output


def test_saved_folder_has_vllms_names_shapes_and_config(tmp_path):
    target = tiny_llama()
    out = EagleHead.for_target(target).save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    weights = load_file(str(out / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in weights.items()} == VLLM_SHAPES
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["dtype"] == "float32"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == getattr(target.config, key), key
    assert (config["polyspec"]["format"] == "polyspec-eagle-head"
            and config["polyspec"]["format_version"] == FORMAT_VERSION)
    assert config["polyspec"]["draft_vocab"] is None and not any(
        p.suffix == ".safetensors" and p.name != "model.safetensors" for p in out.iterdir())
    assert LlamaConfig.from_pretrained(out).num_hidden_layers == 1  # transformers reads it as a plain Llama config


def test_draft_vocabulary_is_saved_beside_the_weights_not_in_them(tmp_path):
    target = tiny_llama()
    head = EagleHead.for_target(target, draft_vocab=torch.tensor([9, 4, 200]))
    out = head.save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    assert set(load_file(str(out / "model.safetensors"))) == set(VLLM_SHAPES)
    assert json.loads((out / "draft_vocab.json").read_text()) == [4, 9, 200]
    assert json.loads((out / "config.json").read_text())["polyspec"]["draft_vocab"] == {"file": "draft_vocab.json",
                                                                                        "size": 3}
    assert EagleHead.from_pretrained(out, target).draft_vocab.tolist() == [4, 9, 200]
    (out / "draft_vocab.json").write_text("[4, 9]")
    with pytest.raises(HeadError, match=r"draft_vocab.json: unreadable draft vocabulary \(ValueError: 2 ids"):
        EagleHead.from_pretrained(out, target)


def test_old_format_head_is_refused_in_one_line_asking_for_retraining(tmp_path):
    target = tiny_llama()
    out = EagleHead.for_target(target).save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    meta = json.loads((out / "config.json").read_text())["polyspec"]
    old = {**meta, "format_version": 1, "architecture": {"decoder_layer": "LlamaDecoderLayer"}}
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(HeadError,
                       match=r"a polyspec-eagle-head v1 head, .*retrain it with `python -m train.eagle`") as err:
        EagleHead.from_pretrained(out, target)
    assert "\n" not in str(err.value)


def test_round_trip_keeps_the_function_with_a_cache(tmp_path):
    target = tiny_llama()
    head = EagleHead(target, init_std=0.2).eval()
    out = head.save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target))
    loaded = EagleHead.from_pretrained(out, target)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(3))
    feats = torch.randn(1, 9, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = head(ids, feats)[1]
        cache = DynamicCache()
        got = torch.cat([loaded(ids[:, :5], feats[:, :5], cache)[1], loaded(ids[:, 5:], feats[:, 5:], cache)[1]], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
