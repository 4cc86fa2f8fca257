"""Tiny random-weight models of the families polyspec promises to run (issue 66), saved as HF folders with the
bundled SmolLM2 tokenizer, as a user would bring them: each family's distinctive features on, in seconds.

Hidden 128 and MLP 256 keep every linear's input a multiple of W4 GPTQ's group size (128); a sliding window of 16
sits well inside a 44-token prompt, so decoding runs past it."""
from __future__ import annotations

from pathlib import Path

import torch

TOKENIZER = "bundled:smollm2-135m-instruct"
WINDOW = 16  # every sliding-window family's window

# A larger init than HF's 0.02 peaks the next-token distributions, so near-ties (which may flip an argmax) stay rare.
_COMMON = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.08, tie_word_embeddings=False)
_GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
              sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh")

# family -> (transformers config class, model class, the family's settings over _COMMON)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _GEMMA),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GEMMA, num_hidden_layers=4, sliding_window_pattern=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # routed experts: 4 experts, 2 a token; every expert's linears 128 or 256 wide
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=256, beta_fast=32.0,
            beta_slow=1.0, truncate=False))),
    # partial rotary (a quarter of each head) and the parallel residual block
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        num_key_value_heads=None, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=0.25), use_parallel_residual=True)),
}


def tiny_family_model(family: str, folder: Path, seed: int = 0) -> Path:
    """`folder` holding a seeded tiny random model of `family` (a key of FAMILIES) and the SmolLM2 tokenizer, in fp32;
    returns the folder."""
    import transformers

    from data.models import load_tokenizer

    config_class, model_class, settings = FAMILIES[family]
    tokenizer = load_tokenizer(TOKENIZER)
    config = getattr(transformers, config_class)(  # a setting of None drops a _COMMON key the class does not take
        **{k: v for k, v in {**_COMMON, **settings}.items() if v is not None}, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    getattr(transformers, model_class)(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
