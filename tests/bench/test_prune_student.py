"""bench/experiments/prune_student.py: the pruned folder loads with transformers alone and computes what the kept layers compute."""

from __future__ import annotations

import pytest


def test_layer_specs_are_parsed_or_refused():
    from bench.experiments.prune_student import parse_layers

    assert parse_layers("0-2,5,8-9", 10) == [0, 1, 2, 5, 8, 9]
    for bad in ("", "3,1", "0-2,2", "0-10"):
        with pytest.raises(ValueError, match="--keep"):
            parse_layers(bad, 10)


def test_pruned_smollm2_loads_and_equals_the_kept_layers(tmp_path, fixtures_dir, one_thread):
    import torch
    import transformers

    from bench.experiments import prune_student
    from csd_pipeline.runtime.model_loading import load_causal_lm

    out = tmp_path / "pruned"
    assert prune_student.main(["--model", "smollm2-135m-instruct", "--keep", "0-1,29", "--output", str(out)]) == 0
    pruned = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert pruned.config.num_hidden_layers == 3 and len(pruned.model.layers) == 3
    full = load_causal_lm("smollm2-135m-instruct", dtype="float32", device="cpu").model.eval()
    full.model.layers = torch.nn.ModuleList(full.model.layers[i] for i in (0, 1, 29))
    ids = torch.as_tensor([tokenizer("In the beginning God created the heaven and the earth.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(pruned(ids).logits, full(ids).logits, rtol=0, atol=1e-5)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
