"""Fixtures of the data tests."""
from __future__ import annotations

import json

import pytest


@pytest.fixture
def sharegpt_file(tmp_path):
    """A small ShareGPT-format JSON file with valid conversations only."""
    records = [
        {"id": f"conv{i}", "conversations": [
            {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
            {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."},
            {"from": "human", "value": "Thanks! And times two?"},
            {"from": "gpt", "value": f"That is {4 * i}."},
        ]}
        for i in range(40)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path
