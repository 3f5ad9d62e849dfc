"""Chat mode of the align stage: one aligned row (schemas/aligned.py, version 1) per chat record.

`ChatAligner` has the interface of `text_mode.TextAligner` (`new_stats`, `align_documents`), so the
align stage's shard writer drives either. Per record (a `corpus.Document` whose text is the record's
JSON), every side renders the conversation with its own template (`chat_render.ChatSide`); the sides must
render the final turn's regions to the same text and the message strings (the history) alike, else
the record is refused with a counted reason. Then, per teacher, a row's chunks are:

    context (everything before the first region)        1 chunk, OUTSIDE_LOSS_REGION
    each content region (reasoning, close, answer)      byte-exact chunks, exactly as text mode
                                                        (`chunks.token_spans` + `chunks.align`)
    the end-of-turn pair                                1:1, ACCEPTED (paired by position: the
                                                        special token each template emits right
                                                        after the content)
    the tail (what the template emits after it)         1 chunk, OUTSIDE_LOSS_REGION

Accepted chunks of regions not in `ChatOptions.kd_regions()` become OUTSIDE_LOSS_REGION; with
`drop_first_assistant_chunk` the first accepted content chunk does too. `student_loss_mask` is true
on the supervised regions' tokens and the end-of-turn token. No context token is added in chat
mode: the template's rendering (with its own BOS, if it writes one) is what the models are fed. A
record longer than a window limit is refused (`longer_than_window`), never cut.
"""

from __future__ import annotations

import json

import numpy as np

from csd_pipeline.align.chat_records import ChatOptions, ChatRefusal
from csd_pipeline.align.chat_render import ChatSide
from csd_pipeline.align.templates import load_chat_template
from csd_pipeline.errors import CsdError
from schemas.aligned import ChunkStatus, aligned_schema, teacher_columns

CHAT_FLAGS = ("--student-chat-template", "--teacher-chat-template", "--include-thinking", "--alignment-regions",
              "--drop-first-assistant-chunk")


# ---------------------------------------------------------------------------------------------
# Stage hooks (called by the align stage, align/stage.py)


def chat_options(config) -> ChatOptions | None:
    """The chat options of an `AlignConfig` (None in text mode); raises `CsdError` for a bad combination.

    Text mode refuses the chat flags; chat mode checks the per-teacher flags against the teacher count.
    """
    given = [flag for flag, value in zip(CHAT_FLAGS, (config.student_chat_template, config.teacher_chat_templates,
                                                      config.include_thinking, config.alignment_regions,
                                                      config.drop_first_assistant_chunk)) if value]
    if config.mode != "chat":
        if given:
            raise CsdError(f"{given[0]} only applies to --mode chat; add --mode chat or drop it.")
        return None
    teachers = len(config.teacher_tokenizers)
    if config.teacher_chat_templates and len(config.teacher_chat_templates) not in (1, teachers):
        raise CsdError(f"--teacher-chat-template was given {len(config.teacher_chat_templates)} times for {teachers} "
                       "teachers; give it once (for all) or once per --teacher-tokenizer, in the same order "
                       "(`default` keeps a teacher's own template).")
    bad = [i for i in config.drop_first_assistant_chunk if not 0 <= i < teachers]
    if bad:
        raise CsdError(f"--drop-first-assistant-chunk {bad[0]} is not a teacher index; use 0..{teachers - 1}.")
    if config.split_on_blank_lines:
        raise CsdError("--split-on-blank-lines reads .txt files, but chat mode reads records with `messages`; drop it.")
    regions = []
    for item in config.alignment_regions:
        regions += [r.strip() for r in item.split(",") if r.strip()]
    options = ChatOptions(
        include_thinking=config.include_thinking,
        alignment_regions=tuple(dict.fromkeys(regions)),
        drop_first_assistant_chunk=tuple(i in config.drop_first_assistant_chunk for i in range(teachers))
        if config.drop_first_assistant_chunk else (),
    )
    options.validate(teachers)
    return options


def template_paths(config) -> list[str | None]:
    """Per side (student, then each teacher) the template file given, or None for the tokenizer's own."""
    given = list(config.teacher_chat_templates)
    if len(given) == 1:
        given = given * len(config.teacher_tokenizers)
    teachers = [None if g in (None, "default") else g for g in given] or [None] * len(config.teacher_tokenizers)
    return [config.student_chat_template, *teachers]


def prepare_chat(config, student, teachers, files) -> dict:
    """Check chat mode's inputs and templates (a probe render per side) before anything is written.

    Returns the `chat` entry of the align identity and processor config. Raises `CsdError`.
    """
    text_files = [f.source for f in files if f.format == "txt"]
    if text_files:
        raise CsdError(f"chat mode reads .jsonl/.json/.parquet records with `messages`, but {text_files[0]} is a .txt "
                       "file; convert it or use --mode text.")
    options = chat_options(config)
    paths = template_paths(config)
    aligner = ChatAligner(student, teachers, config.max_student_tokens, config.teacher_limits(), options, paths)
    aligner.check()
    return {"options": options.record(), "template_files": paths, "templates": aligner.template_records()}


def make_chat_aligner(config: dict, student, teachers) -> ChatAligner:
    """The shard writer's aligner from the processor config's `chat` entry."""
    chat = config["chat"]
    options = ChatOptions(include_thinking=chat["options"]["include_thinking"],
                          alignment_regions=tuple(chat["options"]["alignment_regions"]),
                          drop_first_assistant_chunk=tuple(chat["options"]["drop_first_assistant_chunk"]))
    return ChatAligner(student, teachers, config["max_student_tokens"], config["max_teacher_tokens"], options,
                       chat["template_files"])


# ---------------------------------------------------------------------------------------------
# Rows


class ChatAligner:
    """Renders, compares and aligns chat records into aligned rows (an Arrow table per batch).

    student / teachers: `vocab.vocabulary.TokenizerBundle`s. templates: per side (student first, then each teacher)
    a template file or None (the tokenizer's own). Raises `CsdError` when a template cannot be loaded
    or does not work with its tokenizer (`check`).
    """

    def __init__(self, student, teachers, max_student: int, max_teachers: list[int], options: ChatOptions,
                 templates: list[str | None]):
        self.teachers = teachers
        self.max_student = max_student
        self.max_teachers = list(max_teachers)
        self.options = options
        self.sides: list[ChatSide] = []
        keys: list[tuple[str, str]] = []
        self.side_of_teacher = []
        for i, (bundle, path) in enumerate(zip([student, *teachers], templates, strict=True)):
            who = "student" if i == 0 else f"teacher {i - 1}"
            template = load_chat_template(bundle, path, who)
            key = (bundle.vocab.fingerprint, template.sha256)
            if key not in keys:  # a teacher with the student's tokenizer and template reuses its rendering
                keys.append(key)
                self.sides.append(ChatSide(bundle, template, who))
            if i:
                self.side_of_teacher.append(keys.index(key))
        self.schema = aligned_schema(len(teachers))

    def template_records(self) -> dict:
        """Where each side's template came from and its sha256 (for the manifest)."""
        sides = [self.sides[0], *[self.sides[s] for s in self.side_of_teacher]]
        return {"student": _template_record(sides[0]), "teachers": [_template_record(s) for s in sides[1:]]}

    def check(self) -> None:
        """Probe every side's template with its tokenizer; raise `CsdError` when one cannot work."""
        for side in self.sides:
            side.check(self.options)

    def new_stats(self) -> dict:
        """Counters of one shard (summed across shards by the executor); the text mode layout plus `chat`."""
        from csd_pipeline.align.text_mode import shard_stats

        n = len(self.teachers)
        stats = shard_stats(n)
        stats["chat"] = {"supervised_student_tokens": 0, "supervised_bytes": 0,
                         "dropped_first_assistant_chunk": {f"teacher{i}": 0 for i in range(n)}}
        return stats

    def render_record(self, document) -> tuple:
        """(student rendering, [teacher renderings]) of one document; raises `ChatRefusal`."""
        try:
            record = json.loads(document.text)
        except ValueError:
            raise ChatRefusal("broken_json") from None
        renders = [side.render(record, self.options) for side in self.sides]
        student = renders[0]
        teachers = [renders[s] for s in self.side_of_teacher]
        if len(student.ids) > self.max_student:
            raise ChatRefusal("longer_than_window")
        for teacher, limit in zip(teachers, self.max_teachers, strict=True):
            compare_renderings(student, teacher)
            if len(teacher.ids) > limit:
                raise ChatRefusal("longer_than_window")
        return student, teachers

    def align_documents(self, documents: list, stats: dict):
        """Align a batch of chat documents; return their rows as an Arrow table (refusals are counted)."""
        import pyarrow as pa

        kept = []
        for document in documents:
            try:
                kept.append((document, *self.render_record(document)))
            except ChatRefusal as refusal:
                stats["rejected_documents"][refusal.reason] = stats["rejected_documents"].get(refusal.reason, 0) + 1
        chunks = [self._teacher_chunks(i, kept, stats) for i in range(len(self.teachers))]
        supervised = set(self.options.supervised())
        columns: dict[str, list] = {name: [] for name in self.schema.names}
        for r, (document, student, teachers) in enumerate(kept):
            mask = np.zeros(len(student.ids), dtype=bool)
            for region in student.regions:
                if region.name in supervised:
                    mask[region.start:region.end] = True
                    stats["chat"]["supervised_bytes"] += len(region.text.encode("utf-8"))
            mask[student.eot] = True
            columns["row_id"].append(f"{document.source}:{document.record_index}:0")
            columns["text"].append(student.text)
            columns["student_ids"].append(student.ids)
            columns["student_loss_mask"].append(mask)
            for i, teacher in enumerate(teachers):
                ids_col, s_col, t_col, status_col = teacher_columns(i)
                s_len, t_len, status = chunks[i][r]
                columns[ids_col].append(teacher.ids)
                columns[s_col].append(s_len)
                columns[t_col].append(t_len)
                columns[status_col].append(status)
                _count_chunks(stats[f"teacher{i}"], s_len, t_len, status)
                stats["tokens"][f"teacher{i}"] += len(teacher.ids)
            columns["source"].append(document.source)
            columns["record_index"].append(document.record_index)
            columns["window_index"].append(0)
            columns["byte_start"].append(0)
            size = len(student.text.encode("utf-8"))
            stats["documents"]["aligned"] += 1
            stats["windows"] += 1
            stats["bytes"]["documents"] += size
            stats["bytes"]["windows"] += size
            stats["tokens"]["student"] += len(student.ids)
            stats["chat"]["supervised_student_tokens"] += int(mask.sum())
        arrays = []
        for name in self.schema.names:
            kind = self.schema.field(name).type
            values = columns[name]
            if pa.types.is_list(kind):
                values = [np.asarray(v).tolist() for v in values]
            arrays.append(pa.array(values, kind))
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def _teacher_chunks(self, i: int, kept: list, stats: dict) -> list[tuple[list, list, list]]:
        """Per kept record, teacher i's chunk lengths and statuses (context, regions, eot, tail)."""
        from csd_pipeline.align.chunks import align, token_spans

        student_vocab = self.sides[0].bundle.vocab
        teacher_vocab = self.teachers[i].vocab
        texts, s_ids, t_ids, s_ends, t_ends, owner = [], [], [], [], [], []
        for r, (_, student, teachers) in enumerate(kept):
            teacher = teachers[i]
            for region in student.regions:
                other = teacher.region(region.name)
                texts.append(region.text.encode("utf-8"))
                s_ids.append(student.ids[region.start:region.end])
                t_ids.append(teacher.ids[other.start:other.end])
                s_ends.append(region.ends)
                t_ends.append(other.ends)
                owner.append(r)
        region_chunks: list[list] = [[] for _ in kept]
        if texts:
            src = np.frombuffer(b"".join(texts), dtype=np.uint8)
            doc_bytes = np.zeros(len(texts) + 1, dtype=np.int64)
            np.cumsum([len(t) for t in texts], out=doc_bytes[1:])
            sides = []
            for vocab, ids, ends in ((student_vocab, s_ids, s_ends), (teacher_vocab, t_ids, t_ends)):
                doc_tokens = np.zeros(len(ids) + 1, dtype=np.int64)
                np.cumsum([len(x) for x in ids], out=doc_tokens[1:])
                flat = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
                side = token_spans(vocab, flat, doc_tokens, src, doc_bytes)
                for d in np.flatnonzero(~side.exact).tolist():
                    if ends[d] is not None:
                        side.set_ends(d, ends[d], doc_bytes)
                sides.append(side)
            table = align(src, doc_bytes, sides[0], sides[1])
            s_len, t_len = table.student_len, table.teacher_len
            for d, r in enumerate(owner):
                c0, c1 = table.doc_chunks[d], table.doc_chunks[d + 1]
                region_chunks[r].append((s_len[c0:c1].tolist(), t_len[c0:c1].tolist(), table.status[c0:c1].tolist()))
        kd = set(self.options.kd_regions())
        out = []
        for r, (_, student, teachers) in enumerate(kept):
            teacher = teachers[i]
            lens_s, lens_t, status = [], [], []
            context_s, context_t = student.first_region_token, teacher.first_region_token
            if context_s or context_t:
                lens_s.append(context_s)
                lens_t.append(context_t)
                status.append(int(ChunkStatus.OUTSIDE_LOSS_REGION))
            first_content = len(status)
            dropped = not self.options.drops_first(i)
            for region, (rs, rt, st) in zip(student.regions, region_chunks[r], strict=True):
                if region.name not in kd:
                    st = [int(ChunkStatus.OUTSIDE_LOSS_REGION) if s == ChunkStatus.ACCEPTED else s for s in st]
                elif not dropped and ChunkStatus.ACCEPTED in st:
                    st = list(st)
                    st[st.index(ChunkStatus.ACCEPTED)] = int(ChunkStatus.OUTSIDE_LOSS_REGION)
                    stats["chat"]["dropped_first_assistant_chunk"][f"teacher{i}"] += 1
                    dropped = True
                lens_s += rs
                lens_t += rt
                status += [int(s) for s in st]
            if (not context_s or not context_t) and len(status) > first_content and status[first_content] == 0:
                status[first_content] = int(ChunkStatus.NO_PREDICTOR)
            lens_s.append(1)
            lens_t.append(1)
            status.append(int(ChunkStatus.ACCEPTED if "eot" in kd else ChunkStatus.OUTSIDE_LOSS_REGION))
            tail_s, tail_t = len(student.ids) - student.eot - 1, len(teacher.ids) - teacher.eot - 1
            if tail_s or tail_t:
                lens_s.append(tail_s)
                lens_t.append(tail_t)
                status.append(int(ChunkStatus.OUTSIDE_LOSS_REGION))
            out.append((lens_s, lens_t, status))
        return out


def compare_renderings(student, teacher) -> None:
    """Fail closed: the final turn's regions and every rendered message string must read the same on both
    sides (a template that trims, adds or drops text on one side only refuses the record)."""
    if [(r.name, r.text) for r in student.regions] != [(r.name, r.text) for r in teacher.regions]:
        raise ChatRefusal("final_turn_renders_differently")
    if student.fields != teacher.fields:
        raise ChatRefusal("history_renders_differently")


def _template_record(side: ChatSide) -> dict:
    return {"origin": side.template.origin, "sha256": side.template.sha256,
            "renders_reasoning": side.native_reasoning}


def _count_chunks(counter: dict, s_len: list, t_len: list, status: list) -> None:
    from schemas.aligned import shape_name

    for m, n, s in zip(s_len, t_len, status, strict=True):
        counter["chunk_status"][ChunkStatus(s).name] += 1
        if s == ChunkStatus.ACCEPTED:
            counter["accepted_shapes"][shape_name(m, n)] += 1

