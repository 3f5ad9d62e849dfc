"""Chat mode (csd_pipeline/align/chat_records.py, chat_layout.py, chat_render.py, chat_mode.py): real templates, real tokenizers, real chat data.

References used here are independent of the code under test: transformers' own chat-template
renderer, the `tokenizers` library parsing special tokens from the whole rendering, and brute-force
byte decoding of token ids through the vocabularies.
"""

from __future__ import annotations

import json
import unicodedata
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csd_pipeline.align.chat_mode import ChatAligner
from csd_pipeline.align.chat_records import ChatOptions, ChatRefusal
from csd_pipeline.align.chat_render import ChatSide
from csd_pipeline.align.corpus import Document
from csd_pipeline.align.templates import load_chat_template
from csd_pipeline.errors import CsdError
from schemas.aligned import ChunkStatus

DATA = Path(__file__).resolve().parents[1] / "data"
FAQ = DATA / "python-faq-chat-slice.jsonl"
AWKWARD = DATA / "chat-awkward.jsonl"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct.jinja"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def awkward(case: str) -> dict:
    return next(r for r in records(AWKWARD) if r.get("case") == case)


@cache
def bundle(name: str):
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    return load_tokenizer(name)


def template_file(name: str | None) -> str | None:
    from csd_pipeline.fixtures.names import template_path

    return None if name is None else str(template_path(name))


@cache
def aligner(student: str, teacher: str, student_template=None, teacher_template=None, options=ChatOptions()):
    made = ChatAligner(bundle(student), [bundle(teacher)], 4096, [4096], options,
                       [template_file(student_template), template_file(teacher_template)])
    made.check()
    return made


def align(chat_aligner: ChatAligner, recs: list[dict]) -> tuple[list[dict], dict]:
    stats = chat_aligner.new_stats()
    docs = [Document("test.jsonl", i, json.dumps(r)) for i, r in enumerate(recs)]
    table = chat_aligner.align_documents(docs, stats)
    return table.to_pylist(), stats


@cache
def special_texts(name: str) -> dict[int, bytes]:
    spec = json.loads(bundle(name).raw_json)
    return {t["id"]: t["content"].encode() for t in spec["added_tokens"] if t["special"]}


def spelled(name: str, ids) -> bytes:
    """Brute force: the bytes of token ids (special tokens as their text)."""
    vocab, specials = bundle(name).vocab, special_texts(name)
    return b"".join(specials.get(i, vocab.token_bytes[i]) for i in ids)


def chunk_ranges(row: dict, teacher: int = 0):
    """(status, student range, teacher range) of every chunk of a row."""
    s_len = row[f"teacher{teacher}_chunk_student_len"]
    t_len = row[f"teacher{teacher}_chunk_teacher_len"]
    s0 = t0 = 0
    for m, n, status in zip(s_len, t_len, row[f"teacher{teacher}_chunk_status"], strict=True):
        yield status, (s0, s0 + m), (t0, t0 + n)
        s0, t0 = s0 + m, t0 + n
    assert s0 == len(row["student_ids"]) and t0 == len(row[f"teacher{teacher}_ids"])


def check_accepted_chunks(row: dict, student: str, teacher: str) -> None:
    """Every accepted chunk spells the same non-empty bytes on both sides, or is a pair of special tokens."""
    s_vocab, t_vocab = bundle(student).vocab, bundle(teacher).vocab
    s_ids, t_ids = row["student_ids"], row["teacher0_ids"]
    for status, (s0, s1), (t0, t1) in chunk_ranges(row):
        if status != ChunkStatus.ACCEPTED:
            continue
        assert s0 > 0 and t0 > 0  # a predictor position on both sides
        s_bytes = b"".join(s_vocab.token_bytes[i] for i in s_ids[s0:s1])
        t_bytes = b"".join(t_vocab.token_bytes[i] for i in t_ids[t0:t1])
        if s_bytes == t_bytes == b"":
            assert s1 - s0 == t1 - t0 == 1
            assert s_vocab.is_special[s_ids[s0]] and t_vocab.is_special[t_ids[t0]]
        else:
            assert s_bytes == t_bytes and s_bytes


def masked(row: dict) -> list[int]:
    return [i for i, m in zip(row["student_ids"], row["student_loss_mask"], strict=True) if m]


def final(record: dict) -> dict:
    return record["messages"][-1]


# ---------------------------------------------------------------------------------------------
# python-faq-chat: the loss mask is exactly the final answer plus the end-of-turn token


@pytest.mark.parametrize("student, student_template, eot_text", [
    ("qwen2", None, "<|im_end|>"),
    pytest.param("llama-bpe", LLAMA32, "<|eot_id|>", marks=pytest.mark.slow),
])
def test_faq_mask_is_final_answer_plus_end_of_turn(student, student_template, eot_text):
    from tokenizers import Tokenizer

    recs = records(FAQ)
    rows, stats = align(aligner(student, "smollm2", student_template), recs)
    assert len(rows) == len(recs) == 30 and stats["rejected_documents"] == {}
    # An independent tokenization: the whole rendering with special-token parsing on (fine for this
    # data, whose messages hold no chat delimiters).
    reference = Tokenizer.from_str(bundle(student).raw_json)
    reference.encode_special_tokens = False
    s_eot = special_texts(student)
    t_eot = [i for i, t in special_texts("smollm2").items() if t == b"<|im_end|>"]
    for row, record in zip(rows, recs, strict=True):
        answer = final(record)["content"].encode()
        ids = masked(row)
        assert spelled(student, ids[:-1]) == answer
        assert s_eot.get(ids[-1]) == eot_text.encode()
        assert row["student_ids"] == reference.encode(row["text"], add_special_tokens=False).ids
        assert spelled(student, row["student_ids"]) == row["text"].encode()
        check_accepted_chunks(row, student, "smollm2")
        chunks = list(chunk_ranges(row))
        # context | answer chunks | eot pair | tail ("\n" after the end-of-turn token, ChatML/Llama 3 both)
        assert chunks[0][0] == ChunkStatus.OUTSIDE_LOSS_REGION
        status, (s0, s1), (t0, t1) = chunks[-2] if chunks[-1][0] == ChunkStatus.OUTSIDE_LOSS_REGION else chunks[-1]
        assert status == ChunkStatus.ACCEPTED and row["student_ids"][s0] == ids[-1]
        assert [row["teacher0_ids"][t0]] == t_eot
        content = [c for c in chunks[1:] if c[1][1] <= s0]
        assert b"".join(spelled(student, row["student_ids"][a:b]) for _, (a, b), _ in content) == answer
        assert b"".join(spelled("smollm2", row["teacher0_ids"][a:b]) for _, _, (a, b) in content) == answer
        assert all(c[0] == ChunkStatus.ACCEPTED for c in content)


def test_faq_rendering_matches_transformers_renderer():
    from transformers.utils.chat_template_utils import render_jinja_template

    recs = records(FAQ)[:10]
    for name, template in (("qwen2", None), ("smollm2", None), ("qwen2", QWEN3)):
        side = ChatSide(bundle(name), load_chat_template(bundle(name), template_file(template), "student"), "student")
        for record in recs:
            expected, _ = render_jinja_template([record["messages"]], chat_template=side.template.texts["default"],
                                                **side.variables)
            assert side.render(record, ChatOptions()).text == expected[0]


def test_gguf_templates_reach_the_fixture_configs(fixtures_dir):
    # The SmolLM2 and Qwen2 GGUFs carry tokenizer.chat_template; the fixtures (built with the gguf
    # library) copied it into tokenizer_config.json; --*-chat-template FILE.gguf reads it directly.
    from csd_pipeline.align.templates import gguf_chat_template

    for name, gguf in (("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"), ("qwen2", "ggml-vocab-qwen2.gguf")):
        path = fixtures_dir / "gguf" / gguf
        assert gguf_chat_template(path) == bundle(name).config["chat_template"]
        assert load_chat_template(bundle(name), str(path), "student").sha256 == \
            load_chat_template(bundle(name), None, "student").sha256
    assert gguf_chat_template(fixtures_dir / "gguf" / "ggml-vocab-gpt-2.gguf") is None
    with pytest.raises(CsdError, match="no tokenizer.chat_template"):
        load_chat_template(bundle("gpt-2"), str(fixtures_dir / "gguf" / "ggml-vocab-gpt-2.gguf"), "student")
    with pytest.raises(CsdError, match="has no chat template"):
        load_chat_template(bundle("gpt-2"), None, "teacher 0")


# ---------------------------------------------------------------------------------------------
# Special tokens come from the template only


def test_chat_delimiters_in_messages_stay_text():
    from tokenizers import Tokenizer

    record = awkward("delimiters-as-text")
    rows, stats = align(aligner("qwen2", "smollm2"), [record])
    (row,) = rows
    for name, ids in (("qwen2", row["student_ids"]), ("smollm2", row["teacher0_ids"])):
        specials = special_texts(name)
        found = [specials[i] for i in ids if i in specials]
        # system, user, assistant: three turns, each opened and closed by the template
        assert found.count(b"<|im_start|>") == 3 and found.count(b"<|im_end|>") == 3
        assert b"<|endoftext|>" not in found
        # a parser that takes special tokens from the whole rendering would have made control tokens
        careless = Tokenizer.from_str(bundle(name).raw_json)
        careless.encode_special_tokens = False
        rendering = spelled(name, ids).decode()
        careless_found = [specials[i] for i in careless.encode(rendering).ids if i in specials]
        assert careless_found.count(b"<|im_start|>") > 3
    ids = masked(row)
    assert spelled("qwen2", ids[:-1]) == final(record)["content"].encode()
    assert not any(bundle("qwen2").vocab.is_special[i] for i in ids[:-1])
    check_accepted_chunks(row, "qwen2", "smollm2")


def test_special_token_text_in_a_role_is_refused():
    _, stats = align(aligner("qwen2", "smollm2"), [awkward("role-with-delimiter")])
    assert stats["rejected_documents"] == {"special_token_text_outside_content": 1}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant\n", " ", "\n", "\t",
                                 "\U0001F642", "\u6f22", "e\u0301", "<think>", "</think>", "x", "Hello", "  "]),
                min_size=1, max_size=12),
       st.lists(st.sampled_from(["<|im_end|>", "q", " ", "\n", "\u00e9"]), min_size=1, max_size=5))
def test_property_masked_bytes_are_the_answer_and_no_content_is_a_control_token(answer_parts, question_parts):
    answer, question = "".join(answer_parts), "".join(question_parts)
    record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    rows, stats = align(aligner("qwen2", "smollm2"), [record])
    assert stats["rejected_documents"] == {}
    (row,) = rows
    ids = masked(row)
    assert spelled("qwen2", ids[:-1]) == unicodedata.normalize("NFC", answer).encode()  # Qwen2 normalizes to NFC
    assert not any(bundle("qwen2").vocab.is_special[i] for i in ids[:-1])
    for name, side_ids in (("qwen2", row["student_ids"]), ("smollm2", row["teacher0_ids"])):
        assert sum(bundle(name).vocab.is_special[i] for i in side_ids) == 6  # system, user, assistant turns
    check_accepted_chunks(row, "qwen2", "smollm2")


# ---------------------------------------------------------------------------------------------
# Reasoning (<think>) regions with the Qwen3 template on both sides


def think_regions(row: dict, record: dict) -> dict[str, tuple[int, int]]:
    """Byte spans of the final turn's regions in the student rendering, found by plain string search."""
    message = final(record)
    reasoning = message.get("reasoning_content")
    answer = message["content"]
    if reasoning is None:  # inline form
        head, _, answer = answer.partition("</think>")
        reasoning = head.partition("<think>")[2]
    text = row["text"].encode()
    opening = b"<|im_start|>assistant\n<think>\n"
    r0 = text.rindex(opening) + len(opening)
    r1 = r0 + len(reasoning.strip("\n").encode())
    c1 = r1 + len(b"\n</think>\n\n")
    a1 = c1 + len(answer.lstrip("\n").encode())
    assert text[r1:c1] == b"\n</think>\n\n" and text[c1:a1] == answer.lstrip("\n").encode()
    assert text[a1:].startswith(b"<|im_end|>")
    return {"reasoning": (r0, r1), "close": (r1, c1), "answer": (c1, a1), "eot": (a1, a1 + len(b"<|im_end|>"))}


def token_starts(name: str, ids: list[int]) -> np.ndarray:
    lengths = [len(spelled(name, [i])) for i in ids]
    return np.concatenate([[0], np.cumsum(lengths)])


@pytest.mark.parametrize("include_thinking, regions", [
    (False, ()),
    (True, ()),
    (True, ("reasoning",)),
    (True, ("close",)),
    (True, ("answer",)),
    (True, ("eot",)),
    (True, ("reasoning", "answer", "eot")),
])
def test_reasoning_regions_with_the_qwen3_template(include_thinking, regions):
    options = ChatOptions(include_thinking=include_thinking, alignment_regions=regions)
    chat = aligner("qwen2", "smollm2", QWEN3, QWEN3, options)
    field_form, inline_form = awkward("reasoning-field"), awkward("reasoning-inline")
    rows, stats = align(chat, [field_form, inline_form])
    assert stats["rejected_documents"] == {}
    same = ("text", "student_ids", "student_loss_mask", "teacher0_ids", "teacher0_chunk_student_len",
            "teacher0_chunk_teacher_len", "teacher0_chunk_status")
    assert [rows[0][k] for k in same] == [rows[1][k] for k in same]  # inline <think> == reasoning_content
    row = rows[0]
    spans = think_regions(row, field_form)
    text = row["text"].encode()
    supervised = ("reasoning", "close", "answer", "eot") if include_thinking else ("answer", "eot")
    expected = b"".join(text[slice(*spans[r])] for r in supervised)
    assert spelled("qwen2", masked(row)) == expected
    if include_thinking:  # the opening scaffold stays context
        assert text[:spans["reasoning"][0]].endswith(b"<think>\n")
    starts = token_starts("qwen2", row["student_ids"])
    kd = set(regions or supervised)
    accepted_in = {name: 0 for name in spans}
    for status, (s0, s1), _ in chunk_ranges(row):
        b0, b1 = starts[s0], starts[s1]
        inside = [name for name, (r0, r1) in spans.items() if r0 <= b0 and b1 <= r1]
        if status == ChunkStatus.ACCEPTED:
            assert len(inside) == 1 and inside[0] in kd
            accepted_in[inside[0]] += 1
        elif inside:
            assert status == ChunkStatus.OUTSIDE_LOSS_REGION and inside[0] not in kd
    assert all(accepted_in[name] > 0 for name in kd)
    assert all(accepted_in[name] == 0 for name in spans if name not in kd)
    check_accepted_chunks(row, "qwen2", "smollm2")


def test_reasoning_options_that_cannot_work_are_refused():
    with pytest.raises(CsdError, match="needs --include-thinking"):
        ChatOptions(alignment_regions=("answer",)).validate(1)
    with pytest.raises(CsdError, match="unknown"):
        ChatOptions(include_thinking=True, alignment_regions=("thoughts",)).validate(1)
    with pytest.raises(CsdError, match="render <think> blocks"):
        aligner("qwen2", "smollm2", options=ChatOptions(include_thinking=True, alignment_regions=("answer",)))
    # A reasoning field that the template never renders cannot be trained on.
    _, stats = align(aligner("qwen2", "smollm2", options=ChatOptions(include_thinking=True)),
                     [awkward("reasoning-field")])
    assert stats["rejected_documents"] == {"reasoning_not_rendered": 1}


# ---------------------------------------------------------------------------------------------
# Fail closed: renderings that disagree, malformed records


def test_renderings_that_disagree_are_refused_and_counted():
    # Llama 3.2 trims every message; SmolLM2's ChatML renders them verbatim.
    chat = aligner("llama-bpe", "smollm2", LLAMA32)
    recs = [awkward("final-trailing-newline"), awkward("history-padded"), records(FAQ)[0]]
    rows, stats = align(chat, recs)
    assert stats["rejected_documents"] == {"final_turn_renders_differently": 1, "history_renders_differently": 1}
    assert [r["row_id"] for r in rows] == ["test.jsonl:2:0"]
    # The same records with two ChatML templates render alike.
    rows, stats = align(aligner("qwen2", "smollm2"), recs)
    assert stats["rejected_documents"] == {} and len(rows) == 3


def test_malformed_records_are_refused_with_their_reason():
    _, stats = align(aligner("qwen2", "smollm2"), [awkward("ends-with-user"), awkward("no-messages"),
                                                 {"messages": [{"role": "assistant", "content": ""}]},
                                                 {"messages": [{"role": "user", "content": ["a", "list"]},
                                                               {"role": "assistant", "content": "x"}]},
                                                 {"messages": [{"role": "user", "content": "\ue000"},
                                                               {"role": "assistant", "content": "x"}]}])
    assert stats["rejected_documents"] == {"last_message_not_assistant": 1, "missing_messages": 1,
                                           "empty_final_content": 1, "content_not_string": 1,
                                           "private_use_marker_in_content": 1}
    # Gemma 2's template raises for a system message: counted, not a crash.
    side = ChatSide(bundle("qwen2"), load_chat_template(bundle("qwen2"), template_file("google-gemma-2-2b-it.jinja"),
                                                         "student"), "student")
    with pytest.raises(ChatRefusal, match="template_error"):
        side.render(awkward("multi-turn-unicode"), ChatOptions())


def test_a_template_whose_end_of_turn_is_not_a_special_token_is_an_error():
    # Llama 3's <|eot_id|> is plain text to the Qwen2 tokenizer: nothing ends the turn.
    with pytest.raises(CsdError, match="no_end_of_turn_after_content"):
        aligner("qwen2", "smollm2", LLAMA32)


def test_drop_first_assistant_chunk():
    recs = records(FAQ)[:3]
    plain, _ = align(aligner("qwen2", "smollm2"), recs)
    dropped, stats = align(aligner("qwen2", "smollm2", options=ChatOptions(drop_first_assistant_chunk=(True,))), recs)
    assert stats["chat"]["dropped_first_assistant_chunk"] == {"teacher0": 3}
    for a, b in zip(plain, dropped, strict=True):
        assert a["student_loss_mask"] == b["student_loss_mask"]
        sa, sb = a["teacher0_chunk_status"], b["teacher0_chunk_status"]
        first = sa.index(ChunkStatus.ACCEPTED)
        assert sb[first] == ChunkStatus.OUTSIDE_LOSS_REGION and sb[:first] + sb[first + 1:] == sa[:first] + sa[first + 1:]


# ---------------------------------------------------------------------------------------------
# The stage, as a user runs it


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, tables_for):
    """`csd-pipeline align --mode chat` over the FAQ slice and the awkward records (qwen2 <- smollm2; the
    tables from the test cache)."""
    from cli.main import main

    out = tmp_path_factory.mktemp("chat") / "aligned"
    try:
        main(["align", "--mode", "chat", "--corpus", str(FAQ), "--corpus", str(AWKWARD), "--student-tokenizer",
              "qwen2", "--teacher-tokenizer", "smollm2", "--output", str(out), "--quiet",
              "--tables", *tables_for("qwen2", "smollm2")])
    except SystemExit as exit_:
        assert exit_.code == 0
    return out


def test_align_chat_cli_and_inspect(chat_dir, run_cli):
    import pyarrow.parquet as pq

    code, out, err = run_cli(["inspect", str(chat_dir), "--json"])
    assert code == 0 and not err
    report = json.loads(out)
    assert report["rows"] == 30 + 6
    assert report["rejections"]["documents"] == {"last_message_not_assistant": 1, "missing_messages": 1,
                                                 "special_token_text_outside_content": 1}
    rows = [r for f in sorted(chat_dir.glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 36
    supervised = sum(sum(r["student_loss_mask"]) for r in rows)
    assert report["chat"]["supervised_student_tokens"] == supervised
    assert report["chat"]["supervised_student_tokens_per_row"] == round(supervised / 36, 2)
    by_id = {r["row_id"]: r for r in rows}
    for i, record in enumerate(records(FAQ)):
        row = by_id[f"{FAQ.as_posix()}:{i}:0"] if f"{FAQ.as_posix()}:{i}:0" in by_id else \
            next(r for r in rows if r["row_id"].endswith(f"python-faq-chat-slice.jsonl:{i}:0"))
        assert spelled("qwen2", masked(row)[:-1]) == final(record)["content"].encode()
        check_accepted_chunks(row, "qwen2", "smollm2")
    manifest = json.loads((chat_dir / "manifest.json").read_text())
    assert manifest["config"]["mode"] == "chat" and manifest["config"]["chat"]["templates"]["teachers"][0]["sha256"]
    code, out, _ = run_cli(["inspect", str(chat_dir)])
    assert code == 0 and "supervised_student_tokens_per_row" in out


@pytest.mark.parametrize("extra, message", [
    (["--include-thinking"], "--include-thinking only applies to --mode chat"),
    (["--mode", "chat", "--alignment-regions", "answer"], "needs --include-thinking"),
    (["--mode", "chat", "--include-thinking", "--alignment-regions", "answer,thoughts"], "thoughts is unknown"),
    (["--mode", "chat", "--include-thinking", "--alignment-regions", "answer"], "render <think> blocks"),
    (["--mode", "chat", "--drop-first-assistant-chunk", "3"], "not a teacher index"),
    (["--mode", "chat", "--teacher-chat-template", "a.jinja", "--teacher-chat-template", "b.jinja"], "given 2 times"),
    (["--mode", "chat", "--student-chat-template", "missing.jinja"], "no such file"),
])
def test_align_chat_cli_refuses_unsupported_combinations(extra, message, tmp_path, run_cli):
    code, out, err = run_cli(["align", "--corpus", str(FAQ), "--student-tokenizer", "qwen2", "--teacher-tokenizer",
                              "smollm2", "--output", str(tmp_path / "out"), *extra])
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_end_of_turn_chunk_is_one_explicit_event(chat_dir):
    """The accepted 1:1 chunk of two special tokens: the observed pair plus REST (float64 by hand)."""
    import pyarrow.parquet as pq
    import torch

    from csd_pipeline.events.context import EventContext
    from csd_pipeline.events.row_events import build_row_events
    from csd_pipeline.loss.csd import csd_divergence
    from csd_pipeline.vocab.tables import load_table

    context = EventContext(load_table(chat_dir / "tables/teacher0/student_to_teacher.safetensors"),
                           load_table(chat_dir / "tables/teacher0/teacher_to_student.safetensors"))
    row = pq.read_table(sorted(chat_dir.glob("part-*.parquet"))[0]).slice(0, 1).to_pylist()[0]
    rng = np.random.default_rng(0)
    n_teacher = len(row["teacher0_ids"])
    teacher = {"row_id": row["row_id"], "ids": rng.integers(0, 49152, (n_teacher, 4)),
               "logprobs": np.log(rng.uniform(0.01, 0.2, (n_teacher, 4))),
               "observed_logprob": np.log(rng.uniform(0.05, 0.9, n_teacher))}
    events = build_row_events(row, 0, teacher, context)
    chunks = list(chunk_ranges(row))
    accepted = [c for c in chunks if c[0] == ChunkStatus.ACCEPTED]
    assert events.num_chunks == len(accepted) and events.stats["chunks_special_pair"] == 1
    _, (s0, _), (t0, _) = accepted[-1]  # the end-of-turn pair comes last
    last = events.num_chunks - 1
    (event,) = np.flatnonzero(events.event_chunk == last)
    assert events.final_tok[events.final_event == event].tolist() == [row["student_ids"][s0]]
    assert events.final_pos[events.final_event == event].tolist() == [s0 - 1]
    assert events.chain_chunk[events.chain_chunk == last].size == 0
    assert events.event_teacher_logq[event] == teacher["observed_logprob"][t0 - 1]
    # Only the eot chunk: D(P_T, P_S) with P = (q, 1 - q) on both sides.
    row_eot = dict(row, teacher0_chunk_status=[s if i == len(chunks) - 2 else ChunkStatus.OUTSIDE_LOSS_REGION
                                              for i, s in enumerate(row["teacher0_chunk_status"])])
    assert row_eot["teacher0_chunk_status"][-2] == ChunkStatus.ACCEPTED
    only = build_row_events(row_eot, 0, teacher, context).to("cpu")
    p_student = 0.3
    kd = csd_divergence(torch.zeros(0, dtype=torch.float64), torch.tensor([np.log(p_student)], dtype=torch.float64),
                        only, divergence="jsd")
    q = float(np.exp(teacher["observed_logprob"][t0 - 1]))
    pt, ps = np.array([q, 1 - q]), np.array([p_student, 1 - p_student])
    m = (pt + ps) / 2
    expected = 0.5 * np.sum(pt * np.log(pt / m)) + 0.5 * np.sum(ps * np.log(ps / m))
    assert kd.chunk_count == 1 and abs(float(kd.divergence_sum) - expected) < 1e-12


@pytest.mark.slow
def test_chat_rows_train_with_the_mask(chat_dir, tmp_path, model_path, run_cli):
    """align (chat) -> teacher-logits (SmolLM2) -> csd-train: CE only on the mask, KD only on the region."""
    from csd_pipeline.events.batch import ce_targets
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from trainer.loop import train
    from trainer.options import parse_args

    short = sorted(records(FAQ), key=lambda r: len(json.dumps(r)))[:4] + [awkward("delimiters-as-text")]
    corpus = tmp_path / "chat.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in short), encoding="utf-8")
    aligned, topk, run = tmp_path / "aligned", tmp_path / "topk", tmp_path / "run"
    code, _, err = run_cli(["align", "--mode", "chat", "--corpus", str(corpus), "--student-tokenizer", "qwen2",
                            "--teacher-tokenizer", "smollm2", "--output", str(aligned), "--max-student-tokens", "256",
                            "--tables", *(str(chat_dir / "tables/teacher0" / name) for name in
                                          ("student_to_teacher.safetensors", "teacher_to_student.safetensors")),
                            "--quiet"])
    assert code == 0, err
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(model_path("smollm2-135m-instruct")),
                                           output=str(topk), top_k=8, device="cpu"))
    import pyarrow.parquet as pq

    rows = [r for f in sorted(aligned.glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    positions, tokens = ce_targets([r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows],
                                   [0] * len(rows))
    assert sorted(tokens.tolist()) == sorted(i for r in rows for i in masked(r))  # CE targets == the mask
    config = tmp_path / "student.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 151936, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "max_position_embeddings": 256,
                                  "tie_word_embeddings": True}))
    train(parse_args(["--aligned", str(aligned), "--teacher-logits", str(topk), "--student-config", str(config),
                      "--student-tokenizer", "qwen2", "--output", str(run), "--steps", "1", "--seq-len", "256",
                      "--batch-size", "2", "--workers", "0", "--no-progress", "--save-every", "0"]))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    per_row = [sum(r["student_loss_mask"]) for r in rows]
    assert len(metrics) == 1
    for record in metrics:
        assert record["kd"] > 0 and record["chunks_1to1"] > 0
        assert record["supervised_tokens_per_row"] == record["ce_tokens"] / record["aligned_rows"]
        assert min(per_row) <= record["supervised_tokens_per_row"] <= max(per_row)


@pytest.mark.slow
def test_two_teachers_each_with_its_own_template():
    recs = records(FAQ)[:4]
    chat = ChatAligner(bundle("qwen2"), [bundle("smollm2"), bundle("llama-bpe")], 4096, [4096, 4096], ChatOptions(),
                       [None, None, template_file(LLAMA32)])
    rows, stats = align(chat, recs)
    assert len(rows) == 4 and stats["rejected_documents"] == {}
    single, _ = align(aligner("qwen2", "smollm2"), recs)
    for row, alone, record in zip(rows, single, recs, strict=True):
        assert row["student_loss_mask"] == alone["student_loss_mask"]
        assert [row[k] for k in alone if k.startswith("teacher0")] == [alone[k] for k in alone if k.startswith("teacher0")]
        llama = dict(row, **{k.replace("teacher1", "teacher0"): v for k, v in row.items() if k.startswith("teacher1")})
        check_accepted_chunks(llama, "qwen2", "llama-bpe")
        content = [c for c in chunk_ranges(llama) if c[0] == ChunkStatus.ACCEPTED][:-1]
        assert b"".join(spelled("llama-bpe", llama["teacher0_ids"][a:b]) for _, _, (a, b) in content) == \
            final(record)["content"].encode()


@pytest.mark.slow
def test_chat_shards_do_not_depend_on_workers(chat_dir, tmp_path, run_cli):
    import hashlib

    tables = [str(chat_dir / "tables/teacher0" / n) for n in ("student_to_teacher.safetensors",
                                                              "teacher_to_student.safetensors")]
    hashes = []
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}"
        code, _, err = run_cli(["align", "--mode", "chat", "--corpus", str(FAQ), "--student-tokenizer", "qwen2",
                                "--teacher-tokenizer", "smollm2", "--output", str(out), "--shard-mb", "0.01",
                                "--tables", *tables, "--workers", workers, "--quiet"])
        assert code == 0, err
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["totals"]["shards"] > 2
        hashes.append([hashlib.sha256((out / s["file"]).read_bytes()).hexdigest() for s in manifest["shards"]])
    assert hashes[0] == hashes[1]
