"""The export: every tokenizer file of the student carried, the folder loaded by transformers alone behaves
like the source (tokenizer outputs, chat template, logits), and csd-train refuses an export that does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.trainer_cases import DATA, STUDENT_CONFIG

CHAT = DATA / "python-faq-chat-slice.jsonl"
TEXTS = (DATA / "botchan-slice.txt", DATA / "devil-slice.txt", DATA / "kjv-genesis-slice.txt")


def real_texts() -> list[str]:
    """A few real passages, awkward chat text included (delimiters as text, emoji, CJK)."""
    texts = [path.read_text(encoding="utf-8")[:1500] for path in TEXTS]
    awkward = [json.loads(line) for line in (DATA / "chat-awkward.jsonl").read_text(encoding="utf-8").splitlines()]
    texts += [m["content"] for r in awkward[:3] if isinstance(r.get("messages"), list) for m in r["messages"]
              if isinstance(m, dict) and isinstance(m.get("content"), str)]
    return texts


def chat_records(count: int = 4) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in CHAT.read_text(encoding="utf-8").splitlines()[:count]]


def sample_batch(tokenizer, positions: int = 96) -> SimpleNamespace:
    """A real batch (one row of real text) in the shape of a `MicroBatch`."""
    ids = tokenizer(TEXTS[0].read_text(encoding="utf-8")[:2000], add_special_tokens=False)["input_ids"][:positions]
    return SimpleNamespace(input_ids=np.asarray([ids]), position_ids=np.arange(len(ids))[None])


def assert_same_tokenizer(exported: Path, source: Path) -> None:
    """The export's tokenizer gives the source's outputs on real text and real chat records."""
    from transformers import AutoTokenizer

    got, want = AutoTokenizer.from_pretrained(exported), AutoTokenizer.from_pretrained(source)
    assert len(got) == len(want) and got.all_special_tokens == want.all_special_tokens
    for text in real_texts():
        for special in (False, True):
            assert got(text, add_special_tokens=special)["input_ids"] == want(text, add_special_tokens=special)["input_ids"]
        ids = want(text, add_special_tokens=False)["input_ids"]
        assert got.decode(ids) == want.decode(ids)
    assert got.chat_template == want.chat_template
    if want.chat_template is not None:
        for messages in chat_records():
            for prompt in (False, True):
                turns = messages[:-1] if prompt else messages
                assert got.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt) == \
                    want.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)
                assert got.apply_chat_template(turns, tokenize=True, add_generation_prompt=prompt) == \
                    want.apply_chat_template(turns, tokenize=True, add_generation_prompt=prompt)


def export_student(options, output: Path, tokenizer_source: str, **kwargs) -> None:
    """`export_hf` of the student `options` describes, sharded over one CPU rank as csd-train has it."""
    from trainer import distributed
    from trainer.export import export_hf
    from trainer.model import build_sharded_student

    ctx = distributed.setup("cpu")
    try:
        wrapper = build_sharded_student(options, 0, 32000 if options.student_config else 49152, ctx, torch.float32)
        export_hf(wrapper, tokenizer_source, output, ctx, **kwargs)
    finally:
        distributed.teardown()


@pytest.fixture(scope="module")
def smollm2_layouts(model_path, tmp_path_factory):
    """{"fixture": the fixture's SmolLM2 folder (template inside tokenizer_config.json), "resaved": the same
    model with its tokenizer re-saved by this transformers (template in chat_template.jinja)}."""
    from transformers import AutoTokenizer

    fixture = model_path("smollm2-135m-instruct")
    resaved = tmp_path_factory.mktemp("smollm2-resaved")
    AutoTokenizer.from_pretrained(fixture).save_pretrained(resaved)
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(fixture / name, resaved / name)
    (resaved / "model.safetensors").symlink_to(fixture / "model.safetensors")
    assert (resaved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((resaved / "tokenizer_config.json").read_text())
    return {"fixture": fixture, "resaved": resaved}


@pytest.mark.slow  # over 5 s: the fast tier keeps make test-fast under 2 minutes
# The "resaved" layout (template in chat_template.jinja) is exported, with the same checks, by
# test_csd_train_exports_a_pretrained_student_with_its_chat_template_file (through csd-train).
@pytest.mark.parametrize("layout", ["fixture"])
def test_pretrained_student_export_is_complete_and_checked(smollm2_layouts, layout, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from csd_pipeline.vocab.vocabulary import load_tokenizer
    from trainer.config import StudentConfig
    from trainer.export import TOKENIZER_FILES

    source = smollm2_layouts[layout]
    output = tmp_path / "export"
    export_student(StudentConfig(student=str(source)), output, str(source), student_folder=source,
                   sample=sample_batch(AutoTokenizer.from_pretrained(source)),
                   fingerprint=load_tokenizer(str(source)).vocab.fingerprint)
    carried = [name for name in TOKENIZER_FILES + ("generation_config.json",) if (source / name).is_file()]
    assert "chat_template.jinja" in carried or layout == "fixture"
    for name in carried:
        assert (output / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no *.tmp, no export.failed
    assert_same_tokenizer(output, source)
    assert AutoTokenizer.from_pretrained(output).chat_template  # in whichever form, not lost
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    assert model.config.use_cache and model.generation_config.eos_token_id == 2


def test_from_scratch_student_export_carries_its_tokenizer(tokenizer_path, tmp_path, one_thread):
    from csd_pipeline.vocab.vocabulary import load_tokenizer
    from trainer.config import StudentConfig
    from trainer.export import TOKENIZER_FILES

    config = tmp_path / "student.json"
    config.write_text(json.dumps(STUDENT_CONFIG))
    source = tokenizer_path("llama-spm")
    from transformers import AutoTokenizer

    output = tmp_path / "export"
    export_student(StudentConfig(student_config=str(config), student_tokenizer="llama-spm"), output, "llama-spm",
                   sample=sample_batch(AutoTokenizer.from_pretrained(source)),
                   fingerprint=load_tokenizer("llama-spm").vocab.fingerprint)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            assert (output / name).read_bytes() == (source / name).read_bytes(), name
    assert_same_tokenizer(output, source)
    assert (output / "generation_config.json").is_file()  # transformers' own, from the model config


def test_every_tokenizer_and_processor_file_is_carried(tokenizer_path, tmp_path):
    """Files a student may carry besides tokenizer.json, from a folder or beside a tokenizer.json path."""
    from trainer.export import save_tokenizer

    source = tmp_path / "student"
    shutil.copytree(tokenizer_path("llama-spm"), source)
    extra = {"special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
             "added_tokens.json": "{}", "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
             "preprocessor_config.json": "{}", "video_processor_config.json": "{}",
             "additional_chat_templates/tool_use.jinja": "{{ messages[0]['content'] }}"}
    for name, text in extra.items():
        (source / name).parent.mkdir(exist_ok=True)
        (source / name).write_text(text)
    for argument in (source, source / "tokenizer.json"):
        output = tmp_path / f"export-{argument.name}"
        output.mkdir()
        save_tokenizer(str(argument), output)
        for path in source.rglob("*"):
            if path.is_file():
                assert (output / path.relative_to(source)).read_bytes() == path.read_bytes(), path


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_export_that_does_not_reproduce_the_student_is_one_error_and_the_checkpoint_stays(
        trainer_data, tmp_path, monkeypatch, capsys, one_thread):
    import transformers

    from trainer import checkpoint
    from trainer.main import main

    real = transformers.AutoModelForCausalLM.from_pretrained

    def drifted(*args, **kwargs):  # as if a weight were written wrong: the loaded export is not the student
        model = real(*args, **kwargs)
        with torch.no_grad():
            model.model.norm.weight.add_(1e-3)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", drifted)
    output = tmp_path / "run"
    args = ["--aligned", str(trainer_data["train"]), "--student-config", str(trainer_data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "1",
            "--seq-len", "128", "--batch-size", "1", "--save-every", "0", "--workers", "0", "--no-progress"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: the export"), err
    assert "does not reproduce the student" in err[0] and "checkpoint is kept" in err[0]
    assert [s for s, _ in checkpoint.complete_checkpoints(output)] == [1]
    assert not (output / "export").exists() and (output / "export.failed" / "model.safetensors").is_file()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", real)
    main(args + ["--resume"])  # the same command with --resume writes the export again, checked
    assert (output / "export" / "model.safetensors").is_file() and not (output / "export.failed").exists()


@pytest.mark.slow
def test_csd_train_exports_a_pretrained_student_with_its_chat_template_file(smollm2_layouts, tmp_path, one_thread):
    """End to end: csd-train fine-tunes SmolLM2 whose tokenizer keeps its template in chat_template.jinja; the
    checked export carries it, and its tokenizer and chat template give the source's outputs."""
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.vocab.vocabulary import load_tokenizer
    from tests.csd_cases import cached_table_file
    from trainer.loop import train
    from trainer.options import parse_args

    student = smollm2_layouts["resaved"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXTS[1].read_text(encoding="utf-8")[:1200], encoding="utf-8")
    s, t = load_tokenizer(str(student)), load_tokenizer("llama-spm")
    run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer=str(student), teacher_tokenizers=["llama-spm"],
                          output=str(tmp_path / "aligned"), max_student_tokens=64,
                          tables=[(cached_table_file(s, t), cached_table_file(t, s))]))
    output = tmp_path / "run"
    train(parse_args(["--aligned", str(tmp_path / "aligned"), "--student", str(student), "--output", str(output),
                      "--loss", "ce", "--steps", "1", "--seq-len", "64", "--batch-size", "1", "--lr", "1e-5",
                      "--warmup-steps", "0", "--save-every", "0", "--no-save-final", "--workers", "0",
                      "--no-progress"]))
    from transformers import AutoModelForCausalLM

    from trainer.export import TOKENIZER_FILES

    export = output / "export"
    carried = [name for name in TOKENIZER_FILES + ("generation_config.json",) if (student / name).is_file()]
    assert {"chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(carried)
    for name in carried:
        assert (export / name).read_bytes() == (student / name).read_bytes(), name
    assert not [p.name for p in output.iterdir() if p.name.endswith(".tmp") or p.name == "export.failed"]
    assert not list((output / "checkpoints").glob("step-*"))  # --no-save-final: the export only
    assert_same_tokenizer(export, student)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.config.use_cache and model.generation_config.eos_token_id == 2
