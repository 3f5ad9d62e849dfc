"""Both tables of a (student, teacher) pair and their validation in one call: `make tables`.

`csd-pipeline tables build-both` writes the same two files as two `tables build` calls, byte for
byte, then runs `tables validate` on them, in one process with two small helpers. What costs is
building each tokenizer (`Tokenizer.from_str` holds the GIL: a third of a second at 150k ids, 1.3 s
at 262k) and encoding every spelling of one vocabulary with the other's tokenizer (the canonical
chains). Both go to two helper processes (`vocab.chain_encoder`), started first, one per tokenizer:
each builds its tokenizer while this process reads the vocabularies (from the cache of derived
vocabularies), hands it the other side's spellings and finds the prefix-support entries of both
directions; the chains come back as JSON (nothing unpickled), then both tables are written
(atomically) and read back from disk to be validated. Three processes one after the other did the
same work with the tokenizers built one at a time, twice as many of them, and two more interpreters
importing numpy.
"""

from __future__ import annotations

import os

from csd_pipeline.vocab.chain_encoder import ChainEncoderProcess
from csd_pipeline.vocab.tables import SubtokenTable, count_chains, load_table, spelling_texts, validate_tables

STUDENT_TO_TEACHER = "student_to_teacher.safetensors"
TEACHER_TO_STUDENT = "teacher_to_student.safetensors"


def build_table_pair(student, teacher, chains) -> tuple[SubtokenTable, SubtokenTable]:
    """(student -> teacher, teacher -> student) tables of two loaded `TokenizerBundle`s, each equal to
    `tables.build_table` of that direction (a progress bar on a terminal). `chains`: the two
    `ChainEncoderProcess`es, begun already: the teacher's tokenizer (for the student's spellings),
    then the student's (for the teacher's)."""
    from csd_pipeline.runtime import progress
    from csd_pipeline.vocab.prefix_entries import prefix_entries

    spellings = {"s2t": spelling_texts(student.vocab), "t2s": spelling_texts(teacher.vocab)}
    for encoder, key in zip(chains, spellings):
        encoder.send(spellings[key][1])
    with progress.bar(sum(map(len, (student.vocab.spellings(), teacher.vocab.spellings()))), "tables build-both",
                      "spelling", unit_scale=True) as shown:
        entries = {"s2t": prefix_entries(student.vocab, teacher.vocab, shown.update),
                   "t2s": prefix_entries(teacher.vocab, student.vocab, shown.update)}
    multi = {"s2t": chains[0].result(), "t2s": chains[1].result()}
    tables = []
    for key, source, destination in (("s2t", student, teacher), ("t2s", teacher, student)):
        a, b, n = entries[key]
        canonical = count_chains(destination, (spellings[key][0], multi[key]))
        tables.append(SubtokenTable(source=source.vocab, destination=destination.vocab, prefix_source=a,
                                    prefix_destination=b, prefix_length=n, canonical=canonical))
    return tables[0], tables[1]


def build_and_validate_pair(student_arg: str, teacher_arg: str, output_dir: str | os.PathLike, *,
                            sample: int, trust_remote_code: bool = False) -> dict:
    """Build both tables of (student, teacher) into `output_dir` (a folder or an object-store URL: each table
    uploaded whole, `runtime/storage.py`) as `STUDENT_TO_TEACHER` and `TEACHER_TO_STUDENT`, read them back and validate them against the tokenizers; return
    {"student_to_teacher": path, "teacher_to_student": path, "report": validate_tables' report}.
    Raises CsdError as `tables build` and `tables validate` do."""
    from csd_pipeline.runtime import storage
    from csd_pipeline.vocab.tokenizer_files import open_tokenizer
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    folder = storage.location(output_dir)
    if storage.is_remote(folder):  # a missing bucket or refused credentials fail before the build
        storage.check_writable(folder)
    opened = {arg: open_tokenizer(arg, trust_remote_code=trust_remote_code) for arg in (student_arg, teacher_arg)}
    with ChainEncoderProcess(opened[teacher_arg].file, teacher_arg) as to_teacher, \
            ChainEncoderProcess(opened[student_arg].file, student_arg) as to_student:
        student = load_tokenizer(student_arg, trust_remote_code=trust_remote_code, opened=opened[student_arg])
        teacher = load_tokenizer(teacher_arg, trust_remote_code=trust_remote_code, opened=opened[teacher_arg])
        s2t, t2s = build_table_pair(student, teacher, (to_teacher, to_student))
    paths = {"student_to_teacher": folder / STUDENT_TO_TEACHER, "teacher_to_student": folder / TEACHER_TO_STUDENT}
    s2t.save(paths["student_to_teacher"])
    t2s.save(paths["teacher_to_student"])
    report = validate_tables(student, teacher, load_table(paths["student_to_teacher"]),
                             load_table(paths["teacher_to_student"]), sample=sample)
    return {**paths, "report": report}
