"""Config values are checked before any work: strictly typed flags, writable output folders, and the
stages that use them (quantize.w4, decode.eval) refusing bad values in one line."""
from __future__ import annotations

import errno
import os
import tempfile

import pytest
from omegaconf import OmegaConf

from data.cli import ConfigError, check_writable, flag, run_or_exit


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


def test_run_or_exit_turns_config_errors_into_one_line(capsys):
    def stage():
        raise ConfigError("quantize.overwrite must be true or false, got 'false' (str)")

    with pytest.raises(SystemExit) as exit_:
        run_or_exit(stage, errors=())
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "error: quantize.overwrite must be true or false, got 'false' (str)\n"


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
