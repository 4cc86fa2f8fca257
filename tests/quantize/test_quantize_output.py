"""What `quantize.w4` shows a person: its own progress and results on the terminal, GPTQModel's banner and per-module
tables in the run's library_logs/quantize.w4.log (infra.logs); `verbose=true` leaves GPTQModel's output on the
terminal."""
from __future__ import annotations

from w4_fixtures import stage_config

from quantize.settings import w4_of
from quantize.w4 import run

QUANTIZED_MODULES = 14  # q, k, v, o, gate, up, down of the tiny Llama's 2 layers


def gptqmodel_lines(text: str) -> list[str]:
    """GPTQModel's own lines (LogBar's INFO and WARN lines, its per-module table rows among them)."""
    return [line for line in text.splitlines() if line.startswith(("INFO ", "WARN "))]


def table_rows(text: str) -> list[str]:
    return [line for line in gptqmodel_lines(text) if line.startswith("INFO  | ")]


def test_the_terminal_shows_the_stage_and_the_log_holds_gptqmodels_per_module_output(tiny_source, chat_file, tmp_path,
                                                                                    capfd):
    out = run(w4_of(stage_config(tiny_source, chat_file, tmp_path / "run")))
    terminal = "".join(capfd.readouterr())
    log_file = tmp_path / "run" / "library_logs" / "quantize.w4.log"
    log = log_file.read_text()
    assert (out / "metrics.json").exists()
    assert gptqmodel_lines(terminal) == [] and "GPT-QModel" not in terminal, terminal[-3000:]
    assert len(table_rows(log)) >= QUANTIZED_MODULES, log[-3000:]
    assert f"w4: GPTQModel's own output goes to {log_file}" in terminal
    assert "w4: GPTQ: 100%" in terminal and "held-out perplexity" in terminal, terminal[-3000:]


def test_verbose_keeps_gptqmodels_output_on_the_terminal(tiny_source, chat_file, tmp_path, capfd):
    cfg = stage_config(tiny_source, chat_file, tmp_path / "run")
    cfg.verbose = True
    run(w4_of(cfg))
    terminal = "".join(capfd.readouterr())
    assert len(table_rows(terminal)) >= QUANTIZED_MODULES, terminal[-3000:]
    assert not (tmp_path / "run" / "library_logs").exists()
