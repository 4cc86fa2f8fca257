"""Config values are checked before any work: strictly typed flags, writable output folders, and the
stages that use them (quantize.w4, decode.eval) refusing bad values in one line."""
from __future__ import annotations

import errno
import os
import tempfile

import pytest
from omegaconf import OmegaConf

from infra.cli import (EXIT_INTERRUPTED, EXIT_NOT_PUBLISHED, EXIT_USER_ERROR, ConfigError, Interrupted, check_writable,
                       flag, run_main)


@pytest.mark.parametrize("value", [True, False])
def test_flag_accepts_real_booleans(value):
    assert flag(OmegaConf.create({"a": {"force": value}}).a, "force") is value


@pytest.mark.parametrize("value", ["false", "true", "no", 0, 1, None, "False"])
def test_flag_refuses_anything_else_naming_the_full_key(value):
    cfg = OmegaConf.create({"eval": {"publish": {"force": value}}})
    with pytest.raises(ConfigError, match=r"^eval\.publish\.force must be true or false, got ") as err:
        flag(cfg.eval.publish, "force")
    assert "\n" not in str(err.value)


def test_flag_default_only_for_an_absent_key():
    node = OmegaConf.create({"x": {}}).x
    assert flag(node, "fast", default=False) is False
    with pytest.raises(ConfigError, match="x.fast is missing"):
        flag(node, "fast")
    with pytest.raises(KeyError):
        flag({"k": "yes"}, "k", error=KeyError)


def exit_code(stage) -> int:
    with pytest.raises(SystemExit) as exit_:
        run_main(stage)
    return exit_.value.code


def test_run_main_turns_project_errors_into_one_line_and_exit_2(capsys):
    def stage():
        raise ConfigError("quantize.overwrite must be true or false, got 'false' (str)")

    assert exit_code(stage) == EXIT_USER_ERROR == 2
    assert capsys.readouterr().err == "error: quantize.overwrite must be true or false, got 'false' (str)\n"


def test_run_main_exit_codes(capsys):
    def interrupted():
        raise Interrupted("interrupted at step 3/8; continue with train.resume=true")

    def ctrl_c():
        raise KeyboardInterrupt

    def bug():
        raise KeyError("no such key")

    assert exit_code(lambda: {"metrics": 1}) == 0 and exit_code(lambda: EXIT_NOT_PUBLISHED) == 3
    assert exit_code(interrupted) == exit_code(ctrl_c) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted at step 3/8; continue with train.resume=true\ninterrupted\n"
    with pytest.raises(KeyError):  # a crash keeps its traceback (exit 1)
        run_main(bug)


def test_check_writable_creates_nothing(tmp_path):
    target = tmp_path / "run" / "eval"
    assert check_writable(target, "eval.out_dir") == target
    assert not any(tmp_path.iterdir())
    (tmp_path / "file").write_text("x")
    check_writable(tmp_path / "file", "decode.bench.out", kind="file")
    with pytest.raises(ConfigError, match=r"eval.out_dir=.*file: exists and is not a folder"):
        check_writable(tmp_path / "file", "eval.out_dir")
    with pytest.raises(ConfigError, match=r"eval.out_dir=.*: .*file is not a folder"):
        check_writable(tmp_path / "file" / "eval", "eval.out_dir")


def test_check_writable_refuses_a_read_only_folder(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):  # root ignores permission bits: simulate a read-only mount instead
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))

            monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
        with pytest.raises(ConfigError, match=r"eval.out_dir=.*ro/run/eval: cannot write there \(.*ro: ") as err:
            check_writable(ro / "run" / "eval", "eval.out_dir")
        assert "\n" not in str(err.value)
    finally:
        ro.chmod(0o755)


def read_only_mount(monkeypatch):
    """Every new file fails as on a read-only filesystem (works as root too, unlike permission bits)."""
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)


# ---------------------------------------------------------------------------------------- quantize.w4


def quantize_config(tmp_path, **quantize):
    from pathlib import Path

    cfg = OmegaConf.create({
        "run_name": "t", "run_dir": str(tmp_path), "seed": 0,
        "model": {"name": str(tmp_path / "no-model"), "dtype": "float32"},
        "data": {"source": str(tmp_path / "no-data.json"), "max_len": 256, "held_out_fraction": 0.25},
        "quantize": OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "quantize" / "w4.yaml"),
    })
    cfg.quantize.output = str(tmp_path / "w4")
    for key, value in quantize.items():
        OmegaConf.update(cfg, f"quantize.{key}", value)
    return cfg


@pytest.mark.parametrize("key", ["overwrite", "skip_if_valid", "desc_act", "sym"])
def test_quantize_refuses_string_booleans(tmp_path, key):
    from quantize.settings import w4_of
    from quantize.w4 import QuantizeError, run

    with pytest.raises(QuantizeError, match=rf"^quantize\.{key} must be true or false, got 'false' \(str\)$"):
        run(w4_of(quantize_config(tmp_path, **{key: "false"})))


@pytest.mark.parametrize("key", ["calibration.samples", "eval.agreement_prompts", "eval.timing_repeats"])
def test_quantize_refuses_a_count_of_zero_before_loading(tmp_path, key):
    from quantize.settings import w4_of
    from quantize.w4 import QuantizeError, run

    with pytest.raises(QuantizeError, match=rf"^quantize\.{key} must be an integer >= 1, got 0$"):
        run(w4_of(quantize_config(tmp_path, **{key: 0})))
    assert not any(tmp_path.iterdir())


def test_quantize_refuses_an_unwritable_output_before_loading(tmp_path, monkeypatch):
    from quantize.settings import w4_of
    from quantize.w4 import QuantizeError, run

    read_only_mount(monkeypatch)
    with pytest.raises(QuantizeError, match=r"quantize.output=.*w4: cannot write there \(.*Read-only file system\)"):
        run(w4_of(quantize_config(tmp_path)))  # neither the data nor the model exists: the output check came first


# ---------------------------------------------------------------------------------------- decode.eval


def eval_config(tmp_path, *overrides: str):
    from hydra import compose, initialize

    with initialize(version_base="1.3", config_path="../../conf"):
        return compose("config", overrides=[f"run_dir={tmp_path}", "eval=smoke", *overrides])


@pytest.mark.parametrize("override, message", [
    ("eval.publish.force='false'", r"eval\.publish\.force must be true or false, got 'false' \(str\)"),
    ("eval.publish.force=1", r"eval\.publish\.force must be true or false, got 1 \(int\)"),
    ("decode.fast=yes", r"decode\.fast must be true or false, got 'yes'"),
    ("eval.max_new_tokens='64'", r"eval\.max_new_tokens must be an integer >= 1, got '64'"),
    ("eval.warmup_tokens=-1", r"eval\.warmup_tokens must be an integer >= 0, got -1"),
    ("eval.per_category=0", r"eval\.per_category must be an integer >= 1, got 0"),
    ("eval.plan.mu=[1,0]", r"eval\.plan\.mu\[1\] must be an integer >= 1, got 0"),
    ("eval.plan.repeats=0", r"eval\.plan\.repeats must be an integer >= 1, got 0"),
])
def test_eval_refuses_bad_config_values_before_any_work(tmp_path, override, message):
    from decode.engine.errors import DecodeError
    from decode.eval import run
    from decode.evaluation import EvalError
    from decode.settings import eval_of

    with pytest.raises((EvalError, DecodeError), match=message) as err:
        run(eval_of(eval_config(tmp_path, override)))
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())


def test_eval_refuses_an_unwritable_output_before_decoding(tmp_path, monkeypatch):
    from decode.evaluation import EvalError
    from decode.eval import run
    from decode.settings import eval_of

    read_only_mount(monkeypatch)
    with pytest.raises(EvalError, match=r"^eval.out_dir=.*eval: cannot write there \(.*Read-only file system\)$"):
        run(eval_of(eval_config(tmp_path)))


def test_bench_refuses_an_unwritable_output_before_decoding(tmp_path, monkeypatch):
    from decode.bench import run
    from decode.settings import bench_of
    from infra.cli import ConfigError

    read_only_mount(monkeypatch)
    with pytest.raises(ConfigError,
                       match=r"^decode.bench.out=.*bench.json: cannot write there \(.*Read-only file system\)$"):
        run(bench_of(eval_config(tmp_path)))  # nothing is loaded: the output check comes first


@pytest.mark.parametrize("door, override, message", [
    ("bench_of", "decode.bench.repeats=0", r"decode\.bench\.repeats must be an integer >= 1, got 0"),
    ("bench_of", "decode.bench.llamacpp.sweep=[2,0]", r"decode\.bench\.llamacpp\.sweep\[1\] must be an integer >= 1"),
    ("bench_of", "decode.bench.warmup_tokens=-1", r"decode\.bench\.warmup_tokens must be an integer >= 0, got -1"),
    ("costs_of", "decode.costs.ks=[1,0]", r"decode\.costs\.ks\[1\] must be an integer >= 1, got 0"),
    ("costs_of", "decode.costs.repeats=0", r"decode\.costs\.repeats must be an integer >= 1, got 0"),
])
def test_bench_and_costs_refuse_a_count_below_its_least_at_the_door(tmp_path, door, override, message):
    import decode.settings as settings
    from decode.engine.errors import DecodeError

    with pytest.raises(DecodeError, match="^" + message) as err:
        getattr(settings, door)(eval_config(tmp_path, override))
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())


def test_eval_refuses_an_output_path_that_is_a_file(tmp_path):
    from decode.evaluation import EvalError
    from decode.eval import run
    from decode.settings import eval_of

    (tmp_path / "publish").write_text("not a folder")
    with pytest.raises(EvalError, match=r"^eval.publish.dir=.*publish: exists and is not a folder$"):
        run(eval_of(eval_config(tmp_path)))
