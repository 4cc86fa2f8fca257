"""Draft heads: the EAGLE-2 and EAGLE-3 models the engine drafts with and train/ trains, and their files."""
