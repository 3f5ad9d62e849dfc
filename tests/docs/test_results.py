"""The generated tables of docs/RESULTS.md and docs/results/*.md are what `python -m bench.experiments.results` makes
of docs/results/*.json."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.experiments import results


def test_every_generated_table_agrees_with_its_json():
    pages = results.read_pages()
    assert results.stale(pages, results.blocks()) == [], "run `python -m bench.experiments.results`"
    assert results.main(["--check"]) == 0
    text = pages["RESULTS.md"]
    assert text.index("<!-- results current:") < text.index("## The experiments"), "RESULTS.md opens with the table"


def test_each_experiment_has_its_page_and_results_md_links_it():
    """RESULTS.md is the table and a paragraph per experiment: every page of docs/results/ is linked from it, and
    every block but the summary stands in its experiment's page."""
    text = results.RESULTS_MD.read_text(encoding="utf-8")
    for page in sorted(results.RESULTS_DIR.glob("*.md")):
        assert f"](results/{page.name})" in text, f"RESULTS.md does not link {page.name}"
    assert {page for name, page in results.PAGES.items() if name != "current"} <= \
        {f"results/{page.name}" for page in results.RESULTS_DIR.glob("*.md")}
    assert set(results.PAGES) == set(results.blocks())


def test_a_changed_json_or_a_hand_edited_table_is_caught(tmp_path):
    from bench.experiments.plan import is_ce_arm

    pages = results.read_pages()
    folder = tmp_path / "results"
    shutil.copytree(results.RESULTS_DIR, folder)
    prune = json.loads((folder / "prune.json").read_text(encoding="utf-8"))
    for record in prune["results"]:  # every CE arm: the summary shows the best of them
        if is_ce_arm(record["arm"]):
            record["bits_per_byte"] += 0.01
    (folder / "prune.json").write_text(json.dumps(prune), encoding="utf-8")
    assert results.stale(pages, results.blocks(folder)) == ["current", "prune"]
    text = pages["results/pretrained.md"]
    begin = text.index("<!-- results pretrained:")
    edited = text[:begin] + text[begin:].replace("1.5432", "1.5431", 1)
    assert results.stale({**pages, "results/pretrained.md": edited}, results.blocks()) == ["pretrained"]
    broken = {**pages, "results/pretrained.md": text.replace("<!-- end of results diagnosis -->", "")}
    with pytest.raises(ValueError, match="docs/results/pretrained.md: the markers of block 'diagnosis'"):
        results.updated(broken, results.blocks())


@pytest.mark.parametrize(("name", "where", "stale"), [
    ("quality", ("results", 0, "bits_per_byte"), ["current", "quality"]),
    ("comparison", ("results", 0, "bits_per_byte"), ["current", "comparison"]),
    ("teachers", ("results", 0, "bits_per_byte"), ["current", "teachers-data-limited"]),
    ("teachers", ("reference_bits_per_byte", "pretrained", "student before"), ["teachers-pretrained"]),
    ("onpolicy-multilingual", ("runs", 1, "heldout_by_language", "en"), ["onpolicy"]),
    ("onpolicy-gkd-kl", ("runs", 2, "teacher_bits_per_byte_of_samples"), ["onpolicy-gkd-kl"]),
    ("onpolicy-gkd-reverse-kl", ("runs", 1, "heldout_bits_per_byte"), ["onpolicy-gkd-reverse-kl"]),
])
def test_a_changed_number_in_a_new_json_is_caught(tmp_path, name, where, stale):
    """The tables transcribed into JSON (quality, comparison, teachers) and the on-policy ones: a number changed in
    the file makes its block (and the summary, where the number is CE's or the best arm's) stale."""
    pages = results.read_pages()
    folder = tmp_path / "results"
    shutil.copytree(results.RESULTS_DIR, folder)
    merged = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    *path, key = where
    parent = merged
    for step in path:
        parent = parent[step]
    parent[key] += 0.01
    (folder / f"{name}.json").write_text(json.dumps(merged), encoding="utf-8")
    assert results.stale(pages, results.blocks(folder)) == stale


@pytest.mark.parametrize("name", ["quality", "comparison", "teachers"])
def test_the_transcribed_records_say_so(name):
    merged = json.loads((results.RESULTS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert all(r["source"].startswith("transcribed from docs/RESULTS.md") for r in merged["results"])


def test_the_summary_row_is_the_mean_over_seeds_of_the_json():
    """CE (its best-tuned arm) and the best other arm of `repeated`, recomputed here from pretrained.json: the mean
    over seeds of each run's mean over the five non-English languages."""
    merged = json.loads((results.RESULTS_DIR / "pretrained.json").read_text(encoding="utf-8"))
    languages = ("de", "fr", "es", "ja", "zh-cn")
    means: dict[str, list[float]] = {}
    for run in merged["results"]:
        if run["regime"] == "repeated":
            means.setdefault(run["arm"], []).append(sum(run["bits_per_byte"][lang] for lang in languages) / 5)
    mean = {arm: sum(v) / len(v) for arm, v in means.items()}
    ce_arms = [arm for arm in mean if arm.split(" ")[0] == "ce"]
    ce = min(ce_arms, key=mean.get)
    best = min((arm for arm in mean if arm not in ce_arms), key=mean.get)
    row = next(line for line in results.blocks()["current"].splitlines() if "bench-pretrained" in line)
    assert (f"| {mean[ce]:.4f} (`{ce}`) | `{best}` | {mean[best]:.4f} | {100 * (mean[best] / mean[ce] - 1):+.2f}% |"
            in row)
    assert (best, ce, round(mean[best], 4), round(mean[ce], 4)) == ("csd kl b1 t1.5 fixed0.5 lr1.5e-4 s60",
                                                                    "ce lr1e-4 s60", 1.5299, 1.5419)
