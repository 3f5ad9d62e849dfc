"""Shared pytest fixtures. Several helpers add to this file: keep each section separate."""

from __future__ import annotations

import os

import pytest

# ---------------------------------------------------------------------------------------------
# Real tokenizer/model fixtures (csd_pipeline/fixtures/). Missing fixtures fail, never skip.

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def fixtures_manifest() -> dict:
    """The `fixtures.json` of the fixture cache (fails the test when the cache is incomplete)."""
    from csd_pipeline.fixtures.build import load_manifest
    from csd_pipeline.fixtures.names import fixture_dir

    manifest = load_manifest()
    if manifest is None:
        pytest.fail(f"the fixture cache {fixture_dir()} is missing or incomplete; run `make fixtures`.", pytrace=False)
    return manifest


@pytest.fixture(scope="session")
def fixtures_dir(fixtures_manifest):
    """The fixture cache folder (`csd_pipeline.fixtures.names.fixture_dir()`), known to be complete."""
    from csd_pipeline.fixtures.names import fixture_dir

    return fixture_dir()


@pytest.fixture(scope="session")
def tokenizer_path(fixtures_dir):
    """`tokenizer_path(name)` -> the HF-style folder of a fixture tokenizer (FIXTURE_TOKENIZERS)."""
    from csd_pipeline.fixtures import names as fixtures

    return fixtures.tokenizer_path


@pytest.fixture(scope="session")
def model_path(fixtures_dir):
    """`model_path(name)` -> the HF folder of a fixture model (`smollm2-135m-instruct`)."""
    from csd_pipeline.fixtures import names as fixtures

    return fixtures.model_path


@pytest.fixture(scope="session")
def template_path(fixtures_dir):
    """`template_path(filename)` -> a llama.cpp chat template (`templates/*.jinja`)."""
    from csd_pipeline.fixtures import names as fixtures

    return fixtures.template_path


@pytest.fixture(scope="session")
def tables_for(tokenizer_path):
    """`tables_for(student, teacher)` -> (s2t, t2s) table paths of two fixture tokenizers.

    Building a pair takes seconds, so tables are cached next to the fixtures
    (`tests.csd_cases.cached_table_file`).
    """
    from tests.csd_cases import bundle, cached_table_file

    def get(student: str, teacher: str) -> tuple[str, str]:
        s, t = bundle(tokenizer_path, student), bundle(tokenizer_path, teacher)
        return cached_table_file(s, t), cached_table_file(t, s)

    return get


# --------------------------------------------------------------------------------------------- end of fixtures section


# ---------------------------------------------------------------------------------------------
# `csd-pipeline` run in this process (faster than a subprocess; the same click code path).


@pytest.fixture
def run_cli(capsys):
    """`run_cli(argv)` -> (exit code, stdout, stderr) of `csd-pipeline ARGV` run in this process."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        from cli.main import main

        capsys.readouterr()
        try:
            main([str(a) for a in argv])
            code = 0
        except SystemExit as exit_:
            code = exit_.code
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# --------------------------------------------------------------------------------------------- end of in-process CLI section


# ---------------------------------------------------------------------------------------------
# csd-train (trainer/): inputs built by tests/trainer_cases.py.


@pytest.fixture(scope="session")
def trainer_data(tmp_path_factory) -> dict:
    """Small aligned dirs of real text for the trainer tests (see `tests.trainer_cases.make_trainer_data`)."""
    from tests.trainer_cases import make_trainer_data

    return make_trainer_data(tmp_path_factory.mktemp("trainer-data"))


@pytest.fixture(scope="session")
def trainer_teacher(trainer_data, tmp_path_factory):
    """Teacher top-k (SmolLM2-135M-Instruct, k=8) of `trainer_data["train_short"]` (real model: slow-ish)."""
    from tests.trainer_cases import make_teacher_topk

    return make_teacher_topk(trainer_data["train_short"], tmp_path_factory.mktemp("trainer-teacher") / "topk")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's training runs (the machine is shared; also keeps float reductions in one order)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------- end of csd-train section


# ---------------------------------------------------------------------------------------------
# Small random models with real tokenizers, built once per session (several modules use each).


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory, tokenizer_path):
    """A random 2-layer Llama teacher with the smollm2 tokenizer (`tests.teacher.test_stage.make_tiny_teacher`)."""
    from tests.teacher.test_stage import make_tiny_teacher

    return make_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"), tokenizer_path("smollm2"))


@pytest.fixture(scope="session")
def tiny_student(tmp_path_factory, fixtures_dir):
    """A random 2-layer Llama student with the llama-spm tokenizer (`tests.onpolicy_cases.tiny_student`)."""
    from tests.onpolicy_cases import tiny_student as make_tiny_student

    return make_tiny_student(tmp_path_factory.mktemp("tiny-student") / "student")


# --------------------------------------------------------------------------------------------- end of small models section


# The fast tier's budget (`make test-fast` under 2 minutes on 2 cores): these run in the slow tier only.
# Each leaves a faster sibling of the same code path in the fast tier (named after the arrow).
MOVED_TO_SLOW = {
    "tests/loss/test_teacher_select.py::test_select_row_refuses_rows_of_different_lengths",  # -> test_choice_rules_and_ties
    "tests/fixtures/test_fixtures.py::test_gemma3_converter_reproduces_transformers_ids",  # -> gemma3 vocabulary tests
    "tests/fixtures/test_fixtures.py::test_gguf_reader_agrees_with_the_gguf_package",  # -> the converters' tests
    "tests/vocab/test_vocabulary.py::test_added_token_round_trips_match_the_whole_tokenizer[gemma3+added]",  # -> [gemma3]
    "tests/align/test_stage.py::test_ranks_split_the_work_and_any_rank_can_finalize",  # -> test_rows_match_the_reference
    "tests/align/test_stage.py::test_several_teachers_and_the_identity_teacher",  # -> test_rows_match_the_reference
    "tests/align/test_chat.py::test_align_chat_cli_and_inspect",  # -> the in-process chat align tests
    "tests/align/test_chat.py::test_faq_mask_is_final_answer_plus_end_of_turn[qwen2-None-<|im_end|>]",  # -> other pairs
    "tests/align/test_chat.py::test_align_chat_cli_refuses_unsupported_combinations[extra3-render <think> blocks]",
    "tests/align/test_chat.py::test_renderings_that_disagree_are_refused_and_counted",  # -> test_faq_rendering_matches...
    "tests/report/test_report.py::test_report_writes_a_file_for_each_kind_of_folder",  # -> the other report tests
    "tests/generate/test_stage.py::test_align_reads_the_output_and_trains_only_on_samples",  # -> the stage's tests
    "tests/trainer/test_run.py::test_stop_and_resume_logs_exactly_the_same_losses",  # -> test_uninterrupted_run_...
    "tests/reliability/test_io.py::test_train_into_a_read_only_folder",  # -> test_align_into_a_read_only_folder
    "tests/loss/test_baselines.py::test_loss_and_gradient_match_reference[llama-spm/gpt-2-uld-]",  # -> other pairs
    # -> the same test on gpt-2, smollm2 (ByteLevel) and llama-spm (SentencePiece)
    "tests/vocab/test_vocab_cache.py::test_cached_vocabulary_is_the_derived_one[gemma3]",
    "tests/vocab/test_vocab_cache.py::test_cached_vocabulary_is_the_derived_one[llama-bpe]",
    "tests/vocab/test_vocab_cache.py::test_cached_vocabulary_is_the_derived_one[qwen2]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in MOVED_TO_SLOW:
            item.add_marker(pytest.mark.slow)


# The whole suite's temporary files peak at about 4 GB (2026-12-04: +3.6 GB, a passed test's tmp_path removed at
# its end); CI shares its disk with everything else, and a full disk fails tests far from the cause.
TEMP_BYTES_NEEDED = 5 << 30


def pytest_sessionstart(session):
    """Say at the start (once, not in xdist's workers) when the temporary folder's disk has too little room."""
    import shutil
    import tempfile

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(session.config, "workerinput") or reporter is None:
        return
    where = tempfile.gettempdir()
    free = shutil.disk_usage(where).free
    if free < TEMP_BYTES_NEEDED:
        reporter.write_line(f"warning: {free / (1 << 30):.1f} GiB free under {where}; the suite needs about "
                            f"{TEMP_BYTES_NEEDED >> 30} GiB there: free space, or set TMPDIR to a disk that has it",
                            yellow=True)
