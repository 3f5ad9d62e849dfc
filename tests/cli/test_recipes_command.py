"""`csd-pipeline recipes` lists the shipped recipes and prints one; `csd-train --config` takes them by name."""

from __future__ import annotations

import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.recipes import RECIPES, load_recipe, shipped_recipes
from trainer.options import parse_args

RUN = ["--aligned", "/data/aligned", "--teacher-logits", "/data/teacher", "--student-config", "s.json",
       "--student-tokenizer", "llama-spm", "--output", "/data/run"]


def test_the_listing_is_every_shipped_file_with_its_options(run_cli):
    code, out, _ = run_cli(["recipes"])
    assert code == 0
    rows = dict(line.split(None, 1) for line in out.splitlines())
    files = sorted(p.relative_to(RECIPES).with_suffix("").as_posix() for p in RECIPES.rglob("*.yaml"))
    assert list(rows) == shipped_recipes() == [f for f in files if f != "experiments"]
    assert {"demo/train", "pretrained/csd_kl_b1_t1.5_fixed0.5", "stores/top-128", "teachers/sum"} <= set(rows)
    assert rows["pretrained/train"].startswith("seq_len: 256") and "progress: false" in rows["pretrained/train"]


def test_one_recipe_is_printed_as_its_file(run_cli):
    code, out, _ = run_cli(["recipes", "pretrained/csd_kl_b1_t1.5_fixed0.5"])
    assert code == 0 and out == (RECIPES / "pretrained" / "csd_kl_b1_t1.5_fixed0.5.yaml").read_text(encoding="utf-8")
    code, _, err = run_cli(["recipes", "pretrained/nope"])
    assert code != 0 and "recipe pretrained/nope does not exist" in err and "csd-pipeline recipes" in err


def test_csd_train_takes_a_recipe_by_name_or_a_file_of_ones_own(tmp_path, monkeypatch):
    by_name = parse_args(["--config", "pretrained/train", "--config", "pretrained/csd_kl_b1_t1.5_fixed0.5", *RUN])
    expected = {**load_recipe("pretrained/train"), **load_recipe("pretrained/csd_kl_b1_t1.5_fixed0.5")}
    own = tmp_path / "mine.yaml"
    own.write_text("".join(f"{k}: {v}\n" for k, v in expected.items()).replace("False", "false"), encoding="utf-8")
    assert parse_args(["--config", str(own), *RUN]) == by_name
    (tmp_path / "pretrained").mkdir()
    (tmp_path / "pretrained" / "train").write_text("lr: 1e-3\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # a file of one's own wins over the shipped recipe of the same name
    assert parse_args(["--config", "pretrained/train", *RUN]).to_dict()["lr"] == pytest.approx(1e-3)
    with pytest.raises(CsdError, match="config file no/such does not exist.*shipped recipe's name"):
        parse_args(["--config", "no/such", *RUN])
