"""The engines polyspec is benchmarked beside (decode.bench), run on the same prompts: competitors, not consumers of
its artifacts."""
