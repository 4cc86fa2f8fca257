"""decode.generate prints what it checks: the streamed answer stops at max_new_tokens and just after an
end-of-sequence token, as the chain's returned tokens do, although the chain hands over whole committed blocks."""
from __future__ import annotations

import pytest

from decode.engine.chain import Chain
from decode.generate import clipped, run
from decode.settings import generate_of

EOS = 0


@pytest.mark.parametrize("blocks, limit, shown", [
    ([[1, 2, 3], [4, 5, 6]], 4, [1, 2, 3, 4]),  # the last block runs past the budget
    ([[1, 2], [3, 4]], 4, [1, 2, 3, 4]),  # exactly the budget
    ([[1, EOS, 2], [3]], 10, [1, EOS]),  # an end-of-sequence token inside a block ends the answer
    ([[1, 2], [EOS], [4]], 10, [1, 2, EOS]),
    ([[1, 2, 3, EOS]], 2, [1, 2]),  # the budget ends it before the EOS
])
def test_streaming_stops_where_the_returned_tokens_end(blocks, limit, shown):
    seen: list[list[int]] = []
    stream = clipped(seen.append, limit, [EOS, 99])
    for block in blocks:
        stream(block)
    assert sum(seen, []) == shown and all(seen)  # no empty block is passed on


def test_the_printed_answer_is_the_checked_one(tiny_source, tmp_path, capsys, monkeypatch):
    """Planted: the chain streams one more block after its last committed one (a block past the budget, as a chain's
    last round can commit). The printed answer still equals the decoded returned tokens."""
    from hydra import compose, initialize

    from data.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_source))
    planted = tokenizer.encode("PLANTED")
    returned = []
    generate = Chain.generate

    def overshooting(self, prompt, max_new_tokens, sampling, eos_token_id=None, on_tokens=None):
        result = generate(self, prompt, max_new_tokens, sampling, eos_token_id=eos_token_id, on_tokens=on_tokens)
        on_tokens(planted)
        returned.append(result)
        return result

    monkeypatch.setattr(Chain, "generate", overshooting)
    with initialize(version_base="1.3", config_path="../../conf"):
        cfg = compose("config", overrides=[f"model.name={tiny_source}", f"run_dir={tmp_path}", "decode.chain=lookup",
                                           "decode.prompt=the cat sat on the mat", "decode.max_new_tokens=24",
                                           "decode.fast=false", "decode.compare_ar=false"])
    run(generate_of(cfg))
    printed = capsys.readouterr().out.split("\n\nchain lookup:")[0]
    assert len(returned) == 1 and returned[0].tokens
    assert printed == tokenizer.decode(returned[0].tokens, skip_special_tokens=True)
    assert "PLANTED" not in printed
