"""What the selector tests share: a real top-32 of real text (the tiny teacher, the smollm2 tokenizer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parents[3] / "data"
WIDE = 32


@pytest.fixture(scope="module")
def text_rows(tokenizer_path) -> list[np.ndarray]:
    """Teacher ids of a few paragraphs of real text (kjv-genesis-slice.txt and python-docs-generators-slice.txt)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path("smollm2") / "tokenizer.json"))
    rows = []
    for name in ("kjv-genesis-slice.txt", "python-docs-generators-slice.txt"):
        paragraphs = [p for p in (DATA / name).read_text(encoding="utf-8").split("\n\n") if p.strip()]
        rows += [np.asarray(tokenizer.encode(p).ids[:96], dtype=np.int64) for p in paragraphs[:3]]
    return rows


@pytest.fixture(scope="module")
def tiny_runner(tiny_teacher):
    """`runner(selectors, top_k=WIDE)`: a `TeacherRunner` of the tiny teacher with these position selectors."""
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner
    from csd_pipeline.teacher.store.selectors import TopK

    loaded = load_causal_lm(str(tiny_teacher), device="cpu")

    def runner(selectors=None, top_k: int = WIDE):
        selectors = (TopK(top_k),) if selectors is None else selectors
        return TeacherRunner(loaded, top_k=top_k, vocab_limit=49152, batch_tokens=512, selectors=selectors)

    return runner


@pytest.fixture(scope="module")
def wide_rows(tiny_runner, text_rows):
    """The tiny teacher's top-32 of `text_rows` (every position holds 32 entries)."""
    return tiny_runner().run(text_rows)
