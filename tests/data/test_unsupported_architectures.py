"""A model whose layers keep no KV cache a level can roll back (a recurrent state, linear attention) or that is no
causal LM is refused before any weights load, in one line naming the setting; every promised family passes."""
from __future__ import annotations

import pytest
import transformers
from family_models import FAMILIES

from data.models import ModelSourceError, architecture_problem, load_model

REFUSED = [
    ("MambaConfig", dict(vocab_size=320, hidden_size=16, num_hidden_layers=1, state_size=4), "MambaForCausalLM"),
    ("Qwen3NextConfig", dict(vocab_size=320, hidden_size=16, num_hidden_layers=2, layer_types=[
        "linear_attention", "full_attention"]), "linear_attention layers"),
    ("T5Config", dict(vocab_size=320, d_model=16, num_layers=1), "'t5' is not a decoder-only causal LM"),
]


@pytest.mark.parametrize("config_class, settings, says", REFUSED)
def test_a_model_without_a_croppable_kv_cache_is_refused_before_loading(config_class, settings, says, tmp_path):
    getattr(transformers, config_class)(**settings).save_pretrained(tmp_path)  # a config, no weights, no tokenizer
    with pytest.raises(ModelSourceError, match=f"{says}.*not supported; set model.name") as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_promised_family_is_accepted(family):
    config_class, _, settings = FAMILIES[family]
    assert architecture_problem(getattr(transformers, config_class)(**settings)) is None
