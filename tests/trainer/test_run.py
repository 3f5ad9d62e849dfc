"""csd-train end to end on CPU: resume equality, failed checkpoint writes, export, bits per byte."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch

from csd_pipeline.errors import CsdError
from tests.trainer_cases import metrics
from trainer import checkpoint
from trainer.loop import train
from trainer.options import parse_args

COMPARED = ("step", "loss", "ce", "kd", "lr", "grad_norm", "tokens", "ce_tokens", "chunks_1to1", "chunks_MtoN")


def base_args(data, output, *extra):
    return ["--aligned", str(data["train"]), "--student-config", str(data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "5",
            "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "2",
            "--workers", "0", "--no-progress", *extra]


@pytest.fixture(scope="module")
def reference_run(trainer_data, tmp_path_factory, one_thread):
    output = tmp_path_factory.mktemp("reference") / "run"
    train(parse_args(base_args(trainer_data, output, "--eval-aligned", str(trainer_data["eval"]))))
    return output


def test_uninterrupted_run_learns_and_writes_its_outputs(reference_run):
    rows = metrics(reference_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["ce"] < rows[0]["ce"] - 0.1
    for key in ("loss", "ce", "kd", "lr", "tokens_per_s", "chunks_1to1", "chunks_1toN", "chunks_Mto1", "chunks_MtoN"):
        assert key in rows[0]
    assert [s for s, _ in checkpoint.complete_checkpoints(reference_run)] == [4, 5]  # save_total_limit 2
    assert (reference_run / "config.yaml").is_file() and (reference_run / "export" / "model.safetensors").is_file()
    evaluation = [json.loads(line) for line in open(reference_run / "eval.jsonl", encoding="utf-8")]
    assert evaluation[-1]["step"] == 5 and 0 < evaluation[-1]["bits_per_byte"] < 20


def test_stop_and_resume_logs_exactly_the_same_losses(trainer_data, reference_run, tmp_path, one_thread):
    output = tmp_path / "run"
    train(parse_args(base_args(trainer_data, output, "stop_at_step=3")))
    # as if killed after step 3 but before its checkpoint: step 3 must be recomputed
    shutil.rmtree(output / "checkpoints" / "step-3")
    assert metrics(output)[-1]["step"] == 3
    train(parse_args(base_args(trainer_data, output, "--resume")))
    expected = [{k: r[k] for k in COMPARED} for r in metrics(reference_run)]
    assert [{k: r[k] for k in COMPARED} for r in metrics(output)] == expected  # exact floats


def test_failed_checkpoint_write_keeps_the_previous_one(trainer_data, tmp_path, monkeypatch, one_thread):
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def disk_full(state, checkpoint_id):
        if checkpoint_id.endswith("step-4.tmp"):
            with open(f"{checkpoint_id}/__0_0.distcp", "wb") as handle:
                handle.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", disk_full)
    output = tmp_path / "run"
    with pytest.raises(CsdError, match=r"step-4 failed \(.*No space left.*step-2 is intact"):
        train(parse_args(base_args(trainer_data, output)))
    root = output / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    assert (root / "step-2" / checkpoint.COMPLETE_FILE).is_file()


def test_export_reloads_with_the_same_logits(trainer_data, reference_run):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.model import StudentWithLoss

    exported = AutoModelForCausalLM.from_pretrained(reference_run / "export", dtype=torch.float32).eval()
    # independent path to the same weights: the final DCP checkpoint, loaded without a process group
    config = AutoConfig.from_pretrained(reference_run / "export")
    wrapper = StudentWithLoss(AutoModelForCausalLM.from_config(config))
    state = {"model": wrapper.state_dict()}
    dcp.load(state, checkpoint_id=str(reference_run / "checkpoints" / "step-5"))
    wrapper.load_state_dict(state["model"])
    ids = torch.tensor([[1, 450, 5839, 310, 278, 3186, 29892, 363, 1135, 29889]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, wrapper.model.eval()(ids).logits, rtol=0, atol=1e-6)
    assert (reference_run / "export" / "tokenizer.json").read_bytes() == (
        __import__("csd_pipeline.fixtures.names", fromlist=["x"]).tokenizer_path("llama-spm") / "tokenizer.json").read_bytes()


def test_output_with_checkpoints_needs_resume(trainer_data, reference_run):
    with pytest.raises(CsdError, match="--resume"):
        train(parse_args(base_args(trainer_data, reference_run)))


def test_student_tokenizer_mismatch_names_the_stage(trainer_data, tmp_path):
    args = base_args(trainer_data, tmp_path / "run")
    args[args.index("llama-spm")] = "gpt-2"
    with pytest.raises(CsdError, match="student tokenizer.*re-run csd-pipeline align"):
        train(parse_args(args))


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_gradient_accumulation_matches_the_larger_batch(trainer_data, tmp_path, one_thread):
    # greedy packing puts the same windows in two 1-row micro-batches as in one 2-row batch, and the
    # loss is divided by the global CE-token count of the whole step: the steps must agree (with one
    # lane: with two, consecutive micro-batches come from different lanes)
    train(parse_args(base_args(trainer_data, tmp_path / "a", "steps=3", "save_every=0", "data_lanes=1")))
    train(parse_args(base_args(trainer_data, tmp_path / "b", "steps=3", "save_every=0", "batch_size=1",
                               "grad_accum=2", "data_lanes=1")))
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["ce_tokens"] for r in a] == [r["ce_tokens"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=2e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3)


def test_nonfinite_loss_is_skipped_by_every_rank_and_counted(trainer_data, tmp_path, monkeypatch, one_thread):
    from trainer.model import StudentWithLoss

    real_forward, calls = StudentWithLoss.forward, []

    def poisoned(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            out["ce"] = out["ce"] * float("nan")
        return out

    monkeypatch.setattr(StudentWithLoss, "forward", poisoned)
    output = tmp_path / "run"
    train(parse_args(base_args(trainer_data, output, "steps=3", "save_every=0")))
    rows = metrics(output)
    assert [r["skipped"] for r in rows] == [False, True, False]
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 1]
    assert rows[1]["loss"] == "nan" and rows[2]["ce"] < 20


def test_student_from_an_hf_directory_and_vocab_check(trainer_data, reference_run, tmp_path, one_thread):
    args = base_args(trainer_data, tmp_path / "run", "steps=1", "save_every=0")
    at = args.index("--student-config")
    args[at:at + 2] = ["--student", str(reference_run / "export")]
    args.remove("--student-tokenizer")
    args.remove("llama-spm")  # the tokenizer comes from the model folder
    train(parse_args(args))
    assert metrics(tmp_path / "run")[0]["ce"] < metrics(reference_run)[0]["ce"] - 0.1  # it starts trained
    small = tmp_path / "small.json"
    small.write_text(json.dumps(dict(json.loads(trainer_data["student_config"].read_text()), vocab_size=1000)))
    args = base_args(trainer_data, tmp_path / "run2")
    args[args.index(str(trainer_data["student_config"]))] = str(small)
    with pytest.raises(CsdError, match=r"vocab_size 1000 .* 32000 ids"):
        train(parse_args(args))


def test_bits_per_byte_matches_a_brute_force_count(trainer_data, reference_run):
    import math

    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from csd_pipeline.evaluation.bits_per_byte import bits_per_byte

    model = AutoModelForCausalLM.from_pretrained(reference_run / "export", dtype=torch.float32).eval()
    got = bits_per_byte(model, trainer_data["eval"], seq_len=128, batch_size=2, chunk_size=50)
    nats, n_bytes = 0.0, 0
    manifest = json.loads((trainer_data["eval"] / "manifest.json").read_text())
    with torch.no_grad():
        for shard in manifest["shards"]:
            table = pq.read_table(trainer_data["eval"] / shard["file"]).to_pylist()
            for row in table:
                ids = torch.tensor([row["student_ids"]])
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
                targets = [j for j in range(1, ids.shape[1]) if row["student_loss_mask"][j]]
                nats -= sum(float(logp[j - 1, ids[0, j]]) for j in targets)
                n_bytes += len(row["text"].encode("utf-8"))
    assert got["bytes"] == n_bytes
    assert got["bits_per_byte"] == pytest.approx(nats / n_bytes / math.log(2), rel=1e-5)
    # the trainer's sharded evaluation at the last step scored the same weights
    logged = [json.loads(line) for line in open(reference_run / "eval.jsonl", encoding="utf-8")][-1]
    assert logged["bits_per_byte"] == pytest.approx(got["bits_per_byte"], rel=1e-5)


@pytest.mark.slow
def test_teacher_bits_per_byte_reads_the_teachers_own_ids(trainer_data, reference_run):
    from transformers import AutoModelForCausalLM

    from csd_pipeline.evaluation.bits_per_byte import bits_per_byte
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    teacher = AutoModelForCausalLM.from_pretrained(model_path("smollm2-135m-instruct"), dtype=torch.float32).eval()
    fingerprint = load_tokenizer("smollm2").vocab.fingerprint
    scored = bits_per_byte(teacher, trainer_data["eval"], side=0, seq_len=128, batch_size=2, max_rows=6,
                           fingerprint=fingerprint)
    assert scored["rows"] == 6 and 0.3 < scored["bits_per_byte"] < 2.5  # a real LM on English text
    with pytest.raises(CsdError, match="teacher tokenizer 0"):
        bits_per_byte(teacher, trainer_data["eval"], side=0, seq_len=128, batch_size=2, max_rows=1, fingerprint="0" * 64)


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_the_teachers_score_is_recorded_and_a_student_below_it_is_warned_about(trainer_data, tmp_path, one_thread,
                                                                                capfd):
    """--eval-teacher-bits-per-byte: every evaluation records the teacher's figure; a student that scores
    below it gets a warning (a teacher far above the student: every evaluation), one above it none."""
    warning = "is below the teacher's"
    for teacher, warned in (("1000", True), ("0.001", False)):
        output = tmp_path / teacher
        train(parse_args(base_args(trainer_data, output, "--eval-aligned", str(trainer_data["eval"]), "--eval-every",
                                   "2", "--eval-teacher-bits-per-byte", teacher)))
        evaluation = [json.loads(line) for line in open(output / "eval.jsonl", encoding="utf-8")]
        assert [r["step"] for r in evaluation] == [2, 4, 5]
        assert all(r["teacher_bits_per_byte"] == float(teacher) for r in evaluation)
        err = capfd.readouterr().err
        assert err.count(warning) == (3 if warned else 0), err
    with pytest.raises(CsdError, match="--eval-teacher-bits-per-byte needs --eval-aligned"):
        train(parse_args(base_args(trainer_data, tmp_path / "alone", "--eval-teacher-bits-per-byte", "1.2")))
    with pytest.raises(CsdError, match="--eval-teacher-bits-per-byte must be positive"):
        train(parse_args(base_args(trainer_data, tmp_path / "zero", "--eval-aligned", str(trainer_data["eval"]),
                                   "--eval-teacher-bits-per-byte", "0")))
