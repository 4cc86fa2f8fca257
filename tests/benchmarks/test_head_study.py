"""benchmarks.head_study on the tiny target of tests/train: variants fed the same data share one feature store and
are each charged its build, each row is its own head's metrics, and a second run trains nothing again."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import head_study

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from test_train_eagle import overrides, tiny_setup  # noqa: E402,F401 (a fixture)

pytestmark = pytest.mark.slow


def test_variants_share_a_store_and_rows_accumulate(tiny_setup, tmp_path, monkeypatch, capsys):  # noqa: F811
    common = [o for o in overrides(tiny_setup, tmp_path / "unused") if not o.startswith("run_dir=")]
    root = tmp_path / "study"
    head_study.main(["--root", str(root), "--variants", "default", "epochs_8", "--", *common])
    rows = {r["name"]: r for r in json.loads((root / "results.json").read_text())}
    assert set(rows) == {"default", "epochs_8"}
    assert len(list((root / "dataset" / "eagle_features").glob("*/meta.json"))) == 1
    assert rows["default"]["store_min"] == rows["epochs_8"]["store_min"] > 0
    assert rows["epochs_8"]["tokens_seen"] == 4 * rows["default"]["tokens_seen"] > 0  # 8 epochs, not the common 2
    for name, row in rows.items():
        metrics = json.loads((root / "heads" / name / "metrics.json").read_text())
        assert row["acceptance"] == metrics["eval/acceptance_length_depth3"]  # the common train.eval.depth
        assert row["top1"] == [metrics[f"eval/top1_depth{j}"] for j in (1, 2, 3)]
    monkeypatch.setattr(head_study, "train_variant", lambda *a: pytest.fail("a finished variant trained again"))
    head_study.main(["--root", str(root), "--variants", "default", "epochs_8", "--", *common])
    table = capsys.readouterr().out.splitlines()[-4:]
    assert [line.split("|")[1].strip() for line in table[2:]] == sorted(
        rows, key=lambda n: -rows[n]["acceptance"])
