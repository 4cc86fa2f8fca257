"""The EAGLE-3 head is vLLM's llama_eagle3 function, saved in the layout vLLM and SGLang load (method "eagle3")."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_head_vllm_layout import HEADS, KV, H, INTER, V, rms, rotate, tiny_llama
from transformers import DynamicCache

from data.models import weights_hash
from heads.eagle import EagleHead, HeadError
from heads.eagle3 import Eagle3Head, default_aux_layers, load_head

N_LAYERS = 6  # aux layers (2, 3, 3) by vLLM's default rule; the tests pick their own too
AUX = (0, 2, 5)


def target6():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=N_LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV, max_position_embeddings=256, tie_word_embeddings=True)).eval()


def vllm_shapes(draft_vocab: int) -> dict[str, tuple]:
    m = "midlayer."
    return {"fc.weight": (H, 3 * H), f"{m}input_layernorm.weight": (H,), f"{m}hidden_norm.weight": (H,),
            f"{m}self_attn.q_proj.weight": (H, 2 * H), f"{m}self_attn.k_proj.weight": (H // HEADS * KV, 2 * H),
            f"{m}self_attn.v_proj.weight": (H // HEADS * KV, 2 * H), f"{m}self_attn.o_proj.weight": (H, H),
            f"{m}post_attention_layernorm.weight": (H,), f"{m}mlp.gate_proj.weight": (INTER, H),
            f"{m}mlp.up_proj.weight": (INTER, H), f"{m}mlp.down_proj.weight": (H, INTER), "norm.weight": (H,),
            "lm_head.weight": (draft_vocab, H)}


def aux_states(target, ids: torch.Tensor, layers=AUX) -> torch.Tensor:
    with torch.no_grad():
        states = target.model(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i] for i in layers], -1)


def by_hand(w: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor, g: torch.Tensor,
            positions: torch.Tensor, keys: tuple | None, theta: float, eps: float):  # 8: the formula's inputs
    """vLLM llama_eagle3 from the saved tensors, one call: (pre-norm out, logits, (k, v) incl. the past)."""
    m, T, d = "midlayer.", len(ids), H // HEADS
    x = torch.cat([rms(embed[ids], w[f"{m}input_layernorm.weight"], eps), rms(g, w[f"{m}hidden_norm.weight"], eps)], -1)
    q = rotate((x @ w[f"{m}self_attn.q_proj.weight"].T).view(T, HEADS, d).transpose(0, 1), positions, theta)
    k = rotate((x @ w[f"{m}self_attn.k_proj.weight"].T).view(T, KV, d).transpose(0, 1), positions, theta)
    v = (x @ w[f"{m}self_attn.v_proj.weight"].T).view(T, KV, d).transpose(0, 1)
    past = 0 if keys is None else keys[0].shape[1]
    if keys is not None:
        k, v = torch.cat([keys[0], k], 1), torch.cat([keys[1], v], 1)
    allowed = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0),
                                          attn_mask=allowed).transpose(0, 1).reshape(T, H)
    h = g + attn @ w[f"{m}self_attn.o_proj.weight"].T  # residual: g before hidden_norm
    y = rms(h, w[f"{m}post_attention_layernorm.weight"], eps)
    gate, up = F.silu(y @ w[f"{m}mlp.gate_proj.weight"].T), y @ w[f"{m}mlp.up_proj.weight"].T
    out = h + (gate * up) @ w[f"{m}mlp.down_proj.weight"].T
    return out, rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T, (k, v)


def randomised(head: Eagle3Head) -> Eagle3Head:
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms that are not the identity, so a missing or swapped norm shows
    return head.eval()


def test_default_aux_layers_are_vllms():
    assert default_aux_layers(30) == (2, 15, 27) and default_aux_layers(32) == (2, 16, 29)
    assert all(0 <= i < 2 for i in default_aux_layers(2))


def test_saved_folder_has_vllms_eagle3_names_shapes_config_and_draft_maps(tmp_path):
    target, vocab = target6(), torch.tensor([3, 7, 8, 120, 299])
    head = Eagle3Head.for_target(target, draft_vocab=vocab)
    out = head.save_pretrained(tmp_path / "e3", target_hash=weights_hash(target))
    weights = load_file(str(out / "model.safetensors"))
    d2t, t2d = weights.pop("d2t"), weights.pop("t2d")
    assert {k: tuple(t.shape) for k, t in weights.items()} == vllm_shapes(5)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,)
    assert (torch.arange(5) + d2t).tolist() == vocab.tolist()
    assert t2d.nonzero().flatten().tolist() == vocab.tolist()
    assert d2t.any(), "an all-zero d2t maps draft ids to the wrong tokens"
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[vocab]), "the LM head starts from the target's"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 5 and config["vocab_size"] == V and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and config["tie_word_embeddings"] is False
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps"):
        assert config[key] == getattr(target.config, key), key
    assert config["polyspec"]["method"] == "eagle3" and not (out / "draft_vocab.json").exists()
    assert not any("embed_tokens" in k for k in weights)
    loaded = load_head(out, target)
    assert isinstance(loaded, Eagle3Head) and loaded.aux_layers == (2, 3, 3)
    assert loaded.draft_vocab.tolist() == vocab.tolist()


def test_full_vocabulary_head_has_no_draft_maps_and_methods_are_not_mixed(tmp_path):
    target = target6()
    out = Eagle3Head.for_target(target).save_pretrained(tmp_path / "e3", target_hash=weights_hash(target))
    assert set(load_file(str(out / "model.safetensors"))) == set(vllm_shapes(V))
    with pytest.raises(HeadError, match="an eagle3 head, not an eagle one") as err:
        EagleHead.from_pretrained(out, target)
    assert "\n" not in str(err.value)
    eagle = EagleHead.for_target(target).save_pretrained(tmp_path / "e2", target_hash=weights_hash(target))
    with pytest.raises(HeadError, match="an eagle head, not an eagle3 one"):
        load_head(eagle, target, method="eagle3")
    assert isinstance(load_head(eagle, target), EagleHead)


def test_inconsistent_draft_maps_are_refused(tmp_path):
    target = target6()
    out = Eagle3Head.for_target(target, draft_vocab=torch.tensor([1, 5, 9])).save_pretrained(
        tmp_path / "e3", target_hash=weights_hash(target))
    weights = load_file(str(out / "model.safetensors"))
    save_file({**weights, "d2t": torch.zeros(3, dtype=torch.long)}, str(out / "model.safetensors"))
    with pytest.raises(HeadError, match="d2t and t2d name different draft vocabularies"):
        load_head(out, target)


def test_head_computes_vllms_eagle3_function_from_its_saved_weights(tmp_path):
    """Step 1 from the target's aux states, then two steps from the head's own pre-norm output, with a cache:
    each equals the formula computed from scratch on the saved tensors."""
    target = target6()
    head = randomised(Eagle3Head(target, init_std=0.2, draft_vocab=torch.arange(0, V, 3), aux_layers=AUX))
    out = head.save_pretrained(tmp_path / "e3", target_hash=weights_hash(target))
    w, cfg = load_file(str(out / "model.safetensors")), target.config
    theta, eps, embed = cfg.rope_parameters["rope_theta"], cfg.rms_norm_eps, target.model.embed_tokens.weight
    seq = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(1))
    aux = aux_states(target, seq)[0]
    ids, T = seq[0, 1:], 9
    with torch.no_grad():
        cache = DynamicCache()
        hidden, logits, _ = head(ids[None], aux[None, :T], cache)
        g = aux[:T] @ w["fc.weight"].T
        want, want_logits, kv = by_hand(w, embed, ids, g, torch.arange(T), None, theta, eps)
        torch.testing.assert_close(hidden[0], want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(logits[0], want_logits, atol=1e-5, rtol=1e-4)
        prev, token = want[-1:], torch.tensor([17])
        for step in range(2):  # drafting on from the head's own output (width h: no fc)
            hidden, logits, _ = head(token[None], prev[None], cache)
            want, want_logits, kv = by_hand(w, embed, token, prev, torch.tensor([T + step]), kv, theta, eps)
            torch.testing.assert_close(hidden[0], want, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits[0], want_logits, atol=1e-5, rtol=1e-4)
            prev, token = want, token + 5
    assert head.token_ids(torch.tensor([0, 2])).tolist() == [0, 6]


def test_cached_steps_equal_one_forward_and_round_trip_keeps_the_function(tmp_path):
    target = target6()
    head = randomised(Eagle3Head(target, init_std=0.2, aux_layers=AUX))
    seq = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    aux = aux_states(target, seq)[:, :-1]
    loaded = load_head(head.save_pretrained(tmp_path / "e3", target_hash=weights_hash(target)), target)
    with torch.no_grad():
        _, full, _ = head(seq[:, 1:], aux)
        cache = DynamicCache()
        parts = [loaded(seq[:, 1:6], aux[:, :5], cache)[1]] + [loaded(seq[:, t:t + 1], aux[:, t - 1:t], cache)[1]
                                                               for t in range(6, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)


def test_head_of_other_target_weights_is_refused(tmp_path):
    target = target6()
    out = Eagle3Head.for_target(target).save_pretrained(tmp_path / "e3", target_hash="0" * 16)
    with pytest.raises(HeadError, match="trained for target weights 0000000000000000"):
        load_head(out, target)


def test_two_layer_target_uses_a_layer_it_has():
    head = Eagle3Head.for_target(tiny_llama())
    assert all(0 <= i < 2 for i in head.aux_layers) and head.feature_size == 3 * H
    with pytest.raises(HeadError, match=r"aux layers must be layer ids in \[0, 2\)"):
        Eagle3Head(tiny_llama(), aux_layers=(0, 1, 2))


def test_published_eagle3_head_is_served_with_method_eagle3(tmp_path):
    """chain.json's serve section names vLLM's method from the head folder; a level's `method` must match it."""
    from decode.publish.serving import speculative_config

    target = target6()
    e3 = Eagle3Head.for_target(target).save_pretrained(tmp_path / "e3", target_hash=weights_hash(target))
    e2 = EagleHead.for_target(target).save_pretrained(tmp_path / "e2", target_hash=weights_hash(target))
    drafter = {"kind": "eagle", "draft": {"length": 3}}
    assert speculative_config(drafter, str(e3)) == {"method": "eagle3", "model": str(e3), "num_speculative_tokens": 3}
    assert speculative_config(drafter, str(e2))["method"] == "eagle"

