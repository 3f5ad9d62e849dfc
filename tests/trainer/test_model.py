"""The student built on the meta device, sharded, then filled starts from exactly `build_student`'s weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer_cases import STUDENT_CONFIG
from trainer.config import StudentConfig


def sharded_and_whole(options: StudentConfig, seed: int = 3):
    """(full state and buffers of the FSDP2 student after materialising, the same of `build_student`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer import distributed
    from trainer.model import build_sharded_student, build_student

    size = STUDENT_CONFIG["vocab_size"]
    ctx = distributed.setup("cpu")
    try:
        wrapper = build_sharded_student(options, seed, size, ctx, torch.float32)
        assert all(p.device.type == "cpu" and hasattr(p, "full_tensor") for p in wrapper.parameters())  # sharded
        state = get_model_state_dict(wrapper.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        buffers = {name: b.clone() for name, b in wrapper.model.named_buffers()}
        tied = wrapper.model.lm_head.weight is wrapper.model.get_input_embeddings().weight
    finally:
        distributed.teardown()
    whole = build_student(options, seed, size)
    return (state, buffers, tied), (whole.state_dict(), dict(whole.named_buffers()))


def assert_same(sharded, whole):
    (state, buffers, tied), (ref_state, ref_buffers) = sharded, whole
    assert tied
    assert sorted(state) == sorted(ref_state)
    for name, value in ref_state.items():
        assert torch.equal(state[name], value), name
    assert sorted(buffers) == sorted(ref_buffers)
    for name, value in ref_buffers.items():
        assert torch.equal(buffers[name], value), name


def test_from_scratch_student_starts_from_the_seeded_initialisation(tmp_path):
    path = tmp_path / "student.json"
    path.write_text(json.dumps(STUDENT_CONFIG))
    options = StudentConfig(student_config=str(path), student_tokenizer="llama-spm")
    sharded, whole = sharded_and_whole(options)
    assert_same(sharded, whole)
    other = sharded_and_whole(options, seed=4)[1][0]
    assert not torch.equal(other["model.embed_tokens.weight"], whole[0]["model.embed_tokens.weight"])


def test_pretrained_student_is_loaded_after_materialising(tmp_path):
    import transformers

    config = dict(STUDENT_CONFIG)
    model_type = config.pop("model_type")
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **config))
    model.save_pretrained(tmp_path / "student")
    sharded, whole = sharded_and_whole(StudentConfig(student=str(tmp_path / "student")))
    assert_same(sharded, whole)
    assert torch.equal(whole[0]["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])


def test_vocabulary_smaller_than_the_tokenizer_is_refused_on_the_meta_model(tmp_path):
    from csd_pipeline.errors import CsdError
    from trainer import distributed
    from trainer.model import build_sharded_student

    path = tmp_path / "student.json"
    path.write_text(json.dumps({**STUDENT_CONFIG, "vocab_size": 31999}))
    ctx = distributed.setup("cpu")
    try:
        with pytest.raises(CsdError, match="vocab_size 31999"):
            build_sharded_student(StudentConfig(student_config=str(path), student_tokenizer="llama-spm"), 0,
                                  32000, ctx, torch.float32)
    finally:
        distributed.teardown()
