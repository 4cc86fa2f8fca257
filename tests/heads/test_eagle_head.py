"""The draft head the decode engine codes against: cached = full forward, tree masks, save/load refusal."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

from heads.eagle import EagleHead, HeadError, TrainingRecord, additive_mask, causal_mask

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_target(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False)).eval()


def head_inputs(target, T=10, B=2):
    ids = torch.randint(0, target.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = target(ids, output_hidden_states=True).hidden_states[-1]
    return ids[:, 1:], features[:, :-1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cached_step_by_step_equals_full_forward(family):
    target = tiny_target(family)
    head = EagleHead.for_target(target).eval()
    ids, feats = head_inputs(target)
    with torch.no_grad():
        hidden, logits, _ = head(ids, feats)
        cache = DynamicCache()
        steps = [head(ids[:, :4], feats[:, :4], cache)]  # a prefix, then one token at a time
        steps += [head(ids[:, t:t + 1], feats[:, t:t + 1], cache) for t in range(4, ids.shape[1])]
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(torch.cat([s[0] for s in steps], 1), hidden, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([s[1] for s in steps], 1), logits, atol=1e-5, rtol=1e-4)
    assert hidden.shape == feats.shape and logits.shape == (*ids.shape, target.config.vocab_size)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_mask_branches_see_only_their_ancestors(family):
    """Two sibling branches drafted in one call each equal the branch drafted alone after the prefix."""
    target = tiny_target(family)
    head = EagleHead.for_target(target).eval()
    ids, feats = head_inputs(target, T=8, B=1)
    prefix, P = 5, 5
    # tree after the prefix: node0 = root child a, node1 = root child b, node2 = child of node0
    tree_ids = torch.tensor([[7, 9, 11]])
    tree_feats = torch.randn(1, 3, feats.shape[-1], generator=torch.Generator().manual_seed(2))
    parent = [-1, -1, 0]
    allowed = torch.zeros(3, P + 3, dtype=torch.bool)
    allowed[:, :P] = True
    for i in range(3):
        j = i
        while j >= 0:
            allowed[i, P + j] = True
            j = parent[j]
    depth = torch.tensor([[P, P, P + 1]])
    with torch.no_grad():
        cache = DynamicCache()
        head(ids[:, :prefix], feats[:, :prefix], cache)
        tree_hidden, tree_logits, _ = head(tree_ids, tree_feats, cache, position_ids=depth,
                                           attention_mask=additive_mask(allowed, torch.float32)[None, None])
        for path in ([0, 2], [1]):
            c = DynamicCache()
            head(ids[:, :prefix], feats[:, :prefix], c)
            h, lg, _ = head(tree_ids[:, path], tree_feats[:, path], c)
            torch.testing.assert_close(h, tree_hidden[:, path], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(lg, tree_logits[:, path], atol=1e-5, rtol=1e-4)


def test_head_holds_only_its_own_weights_and_shares_the_targets():
    target = tiny_target("llama")
    head = EagleHead.for_target(target)
    names = set(head.state_dict())
    assert names and all(n.startswith(("fc.", "layers.0.")) for n in names)
    assert head.lm_head is target.lm_head and head.embed_tokens is target.model.embed_tokens
    assert all(p.requires_grad for p in head.parameters())
    assert not any(p.requires_grad for p in target.lm_head.parameters())


def test_causal_mask_offsets_by_the_cache():
    m = causal_mask(2, 3, torch.float32, "cpu")
    assert m.shape == (1, 1, 2, 5)
    assert (m[0, 0, 0, :4] == 0).all() and m[0, 0, 0, 4] < -1e30 and (m[0, 0, 1] == 0).all()


def test_save_and_load_roundtrip_and_refusals(tmp_path):
    from data.models import weights_hash

    target = tiny_target("llama")
    head = EagleHead.for_target(target)
    out = head.save_pretrained(tmp_path / "eagle", target_hash=weights_hash(target),
                               record=TrainingRecord(metrics={"acc": 0.5}))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())["polyspec"]
    assert config["target"]["weights_hash"] == weights_hash(target) and config["feature_source"] == "target"
    loaded = EagleHead.from_pretrained(out, target)
    ids, feats = head_inputs(target)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, feats)[1], head(ids, feats)[1])
    other = tiny_target("llama")
    with torch.no_grad():
        other.lm_head.weight.add_(1.0)
    with pytest.raises(HeadError, match="trained for target weights"):
        EagleHead.from_pretrained(out, other)
    with pytest.raises(HeadError, match="not an EAGLE head folder"):
        EagleHead.from_pretrained(tmp_path, target)


def test_target_without_decoder_layer_class_is_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(HeadError, match="no usable decoder-layer class") as err:
        EagleHead.for_target(gpt2)
    assert "\n" not in str(err.value)


def test_head_of_another_vocabulary_is_refused(tmp_path):
    from data.models import load_tokenizer, weights_hash

    tokenizer = load_tokenizer("bundled:smollm2-135m-instruct")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)})).eval()
    out = EagleHead.for_target(target).save_pretrained(tmp_path / "eagle", weights_hash(target), tokenizer)
    EagleHead.from_pretrained(out, target, tokenizer)
    tokenizer.add_tokens(["<polyspec-new-token>"])
    with pytest.raises(HeadError, match="different tokenizer vocabulary"):
        EagleHead.from_pretrained(out, target, tokenizer)


def test_draft_vocabulary_logits_are_the_full_logits_at_its_tokens_and_survive_save_load(tmp_path):
    from data.models import weights_hash

    target = tiny_target("llama")
    vocab = torch.tensor([250, 3, 17, 42, 3])  # unsorted, with a repeat: stored sorted and unique
    head = EagleHead.for_target(target, draft_vocab=vocab).eval()
    full = EagleHead.for_target(target).eval()
    full.load_state_dict({k: v for k, v in head.state_dict().items() if k != "draft_vocab"})
    ids, feats = head_inputs(target)
    with torch.no_grad():
        _, sub_logits, _ = head(ids, feats)
        _, full_logits, _ = full(ids, feats)
    assert head.draft_vocab.tolist() == [3, 17, 42, 250]
    torch.testing.assert_close(sub_logits, full_logits[..., head.draft_vocab])
    assert head.token_ids(torch.tensor([0, 3])).tolist() == [3, 250]
    probs = torch.softmax(sub_logits[0, 0], -1)
    spread = head.full_vocab(probs)
    assert (spread.shape == (target.config.vocab_size,) and spread[head.draft_vocab].equal(probs)
            and spread.sum().item() == pytest.approx(1.0))
    head.save_pretrained(tmp_path / "head", target_hash=weights_hash(target))
    loaded = EagleHead.from_pretrained(tmp_path / "head", target)
    assert loaded.draft_vocab.tolist() == [3, 17, 42, 250]
    with pytest.raises(HeadError, match="draft vocabulary"):
        EagleHead(target, draft_vocab=torch.tensor([target.config.vocab_size]))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss", "gpt_neox", "llama"])
def test_a_head_has_a_dense_llama_layer_where_the_target_has_no_llama_style_one(family, tmp_path):
    """Mixture-of-experts targets (and GPT-NeoX, whose layer takes its cache as `layer_past`, so a head of its class
    never wrote its cache) get one dense Llama layer of their width for both heads, the layout vLLM and SGLang serve
    for them: every weight finite from the start (the experts of a head of the target's class were never
    initialised), saved as a Llama EAGLE head, loaded back computing the same. Llama keeps its own layer."""
    from family_models import tiny_family_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from data.models import load_model, weights_hash
    from heads.eagle3 import Eagle3Head, load_head

    target, tokenizer = load_model(str(tiny_family_model(family, tmp_path / "target")))
    ids, features = head_inputs(target)
    for cls, architecture in ((EagleHead, "LlamaForCausalLM"), (Eagle3Head, "LlamaForCausalLMEagle3")):
        torch.manual_seed(0)
        head = cls.for_target(target)
        layer = head.layer if cls is EagleHead else head.midlayer
        assert type(layer) is LlamaDecoderLayer and head.config.hidden_size == target.config.hidden_size
        assert head.config.intermediate_size == target.config.intermediate_size
        assert all(torch.isfinite(t).all() for t in head.state_dict().values())
        head.save_pretrained(tmp_path / cls.method, weights_hash(target), tokenizer)
        config = json.loads((tmp_path / cls.method / "config.json").read_text())
        assert config["architectures"] == [architecture] and config["model_type"] == "llama"
        loaded = load_head(tmp_path / cls.method, target, tokenizer)
        step = features if cls is EagleHead else torch.cat([features] * 3, -1)
        with torch.no_grad():
            assert torch.equal(loaded(ids, step)[1], head(ids, step)[1])
