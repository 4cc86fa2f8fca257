"""Draft vocabularies are chosen from assistant tokens only, by frequency, and always keep forced ids."""
from data.vocab import assistant_token_counts, coverage, top_tokens


def test_counts_only_assistant_positions_and_top_tokens_keep_forced_ids():
    counts = assistant_token_counts([([5, 6, 6, 7, 9], [0, 1, 1, 1, 0]), ([6, 8, 8], [1, 1, 1])])
    assert counts == {6: 3, 7: 1, 8: 2}
    assert top_tokens(counts, 2, vocab_size=100).tolist() == [6, 8]
    assert top_tokens(counts, 2, vocab_size=100, always=[99]).tolist() == [6, 99]  # forced ids count toward n
    assert top_tokens(counts, 10, vocab_size=8).tolist() == [6, 7]  # ids outside the vocabulary are dropped
    assert coverage(counts, top_tokens(counts, 2, vocab_size=100)) == 5 / 6
