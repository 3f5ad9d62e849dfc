"""Bad options and awkward inputs are refused with one line (issue 16, item 5)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from csd_pipeline.errors import CsdError
from tests.reliability.cases import CORPUS


def cli(capsys, *argv) -> tuple[int, str]:
    """Run `csd-pipeline ARGV` in this process; (exit code, stderr)."""
    from cli.main import main

    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as done:
        code = done.code or 0
    return code, capsys.readouterr().err.strip()


def assert_refused(outcome: tuple[int, str], *fragments: str) -> None:
    code, err = outcome
    assert code == 2, (code, err)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err


def align(output, *extra) -> list:
    return ["align", "--corpus", CORPUS, "--student-tokenizer", "llama-spm", "--teacher-tokenizer", "smollm2",
            "--output", output, "--quiet", *extra]


def test_side_out_of_range(trainer_data, capsys):
    assert_refused(cli(capsys, "bits-per-byte", "--aligned", trainer_data["eval"], "--model", "unused",
                       "--side", "teacher7"),
                   "--side teacher7 is out of range", "aligns 1 teacher(s)", "teacher0")


def test_batch_mb_zero(tmp_path, capsys):
    assert_refused(cli(capsys, *align(tmp_path / "out", "--batch-mb", "0")), "--batch-mb 0 is not a positive size")
    assert_refused(cli(capsys, *align(tmp_path / "out", "--shard-mb", "-1")), "--shard-mb -1 is not a positive size")
    assert not (tmp_path / "out").exists()


def test_tables_with_one_file(tmp_path, capsys):
    table = tmp_path / "s2t.safetensors"
    table.write_bytes(b"")
    outcome = cli(capsys, "align", "--corpus", CORPUS, "--student-tokenizer", "llama-spm", "--teacher-tokenizer",
                  "smollm2", "--tables", table, "--output", tmp_path / "out")
    assert_refused(outcome, "--tables takes two files", "followed by the option --output")


def test_fifo_as_corpus_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    # a reader that blocked would wait for a writer forever: this one opens the other end after 20 s
    release = threading.Timer(20, lambda: open(fifo, "wb").close())
    release.start()
    try:
        assert_refused(cli(capsys, *align(tmp_path / "out")[:2], fifo, *align(tmp_path / "out")[3:]),
                       "is not a regular file")
        assert release.is_alive(), "align waited on the FIFO"
    finally:
        release.cancel()


def test_corpus_whose_every_record_is_rejected(tmp_path, capsys, tables_for):
    corpus = tmp_path / "records.jsonl"
    corpus.write_text('{"body": "text under another field"}\n{"body": "and again"}\n', encoding="utf-8")
    outcome = cli(capsys, "align", "--corpus", corpus, "--student-tokenizer", "llama-spm", "--teacher-tokenizer",
                  "smollm2", "--output", tmp_path / "out", "--quiet",
                  "--tables", *tables_for("llama-spm", "smollm2"))
    assert_refused(outcome, "holds 0 aligned rows", "missing_text_field: 2", "--text-field")


def test_progress_takes_a_value(tmp_path):
    from trainer.options import parse_args

    base = ["--aligned", "a", "--output", "o", "--student", "s", "--loss", "ce"]
    assert parse_args([*base, "--progress", "false"]).progress is False
    assert parse_args([*base, "--progress", "off"]).progress is False
    assert parse_args([*base, "--progress", "true"]).progress is True
    assert parse_args([*base, "--progress", "--resume"]).progress is True  # a bare flag still means true
    assert parse_args([*base, "--progress=false"]).progress is False and parse_args([*base, "progress=0"]).progress is False
    with pytest.raises(CsdError, match="unexpected argument 'maybe'"):
        parse_args([*base, "--progress", "maybe"])


class PlantedCommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def tiny_model_folder(folder, extra=None):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.trainer_cases import STUDENT_CONFIG

    config = AutoConfig.for_model(**dict(STUDENT_CONFIG, vocab_size=512))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir()
    config.save_pretrained(folder)
    state = {key: value.contiguous() for key, value in model.state_dict().items()}
    state.update(extra or {})
    torch.save(state, folder / "pytorch_model.bin")
    return model


def test_pickled_weight_file_that_weights_only_refuses(tmp_path):
    from csd_pipeline.runtime.model_loading import load_causal_lm

    marker = tmp_path / "ran"
    tiny_model_folder(tmp_path / "planted", {"planted": PlantedCommand(marker)})
    with pytest.raises(CsdError) as err:
        load_causal_lm(str(tmp_path / "planted"), device="cpu")
    message = str(err.value)
    assert "\n" not in message and "holds more than tensors" in message and "posix.system" in message, message
    assert not marker.exists()
    # an ordinary pytorch_model.bin keeps loading, with its weights
    model = tiny_model_folder(tmp_path / "ordinary")
    loaded = load_causal_lm(str(tmp_path / "ordinary"), device="cpu")
    for (name, expected), (_, found) in zip(model.state_dict().items(), loaded.model.state_dict().items()):
        assert torch.equal(expected, found), name
