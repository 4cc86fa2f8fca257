"""Polybasic speculative decoding: an n-level lossless chain (chain.py), its baselines, CLI and benchmark."""
