"""Shared ground for every stage: model sources, ShareGPT data, prompt sets, tracking."""
