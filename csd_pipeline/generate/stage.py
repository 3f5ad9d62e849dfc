"""The generate stage: the student writes completions for a prompt corpus, in resumable shards.

`GenerateStage(config)` reads the prompts (the corpus readers of the align stage: text mode, field
`--prompt-field`, optionally cut to a prefix of `--prompt-chars`; chat mode, whole chat records whose
final assistant turn is written, `chat_prompts.py`), loads the student's tokenizer and declares what
the shared executor (`runtime.executor.run_stage`) needs:

- identity: the config's sampling settings, the student's fingerprint, the corpus fingerprints;
- plan: the prompts in corpus order, `--prompts-per-shard` per shard (the prompts travel in the
  plan, so a re-run resumes the same shards);
- shard writer: `GenerateShardWriter`, which loads the student once per process and writes one JSON
  line per sample: text mode {"prompt", "completion", "source", "record_index", "sample", "finish",
  "completion_tokens"[, "reference"]}; chat mode the prompt record with the written turn and a
  `generated` field (`chat_prompts.written_record`).

A shard's bytes depend only on its prompts and the config: samples are generated in fixed groups of
`--batch-size` within the shard, each with a seed derived from (seed, source, record index, sample).
The output folder is a corpus: `csd-pipeline align --corpus DIR` reads its shards in manifest order,
as prompt/completion records (`align/prompt_completion.py`), or with `--mode chat` as chat records.
"""

from __future__ import annotations

import json
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.generate.config import GenerateConfig
from csd_pipeline.runtime.executor import (
    ShardResult,
    ShardTask,
    Stage,
    check_output_dir,
    numbered_tasks,
    run_configured,
)
from csd_pipeline.runtime.storage import location

STAGE = "generate"
SCHEMA_VERSION = 1
WHITESPACE = " \t\r\n\f\v"


def run_generate(config: GenerateConfig, *, rank: int | None = None, world_size: int | None = None, workers: int = 1,
                 engine=None, log=None):
    """Run (or resume) the generate stage for this rank (engine: the `EngineConfig`, default local); returns
    the executor's `RunReport`."""
    return run_configured(config, lambda: GenerateStage(config, log), rank=rank, world_size=world_size,
                          workers=workers, engine=engine, log=log)


class GenerateStage(Stage):
    """The generate stage of one `GenerateConfig`."""

    name = STAGE
    schema_version = SCHEMA_VERSION
    suffix = ".jsonl"
    recorded = ("mode", "prompt_field", "prompt_chars", "max_new_tokens", "temperature", "top_p", "samples_per_prompt",
                "seed", "batch_size", "prompts_per_shard", "backend", "dtype", "device_type")

    def __init__(self, config: GenerateConfig, log=None):
        from csd_pipeline.align.corpus import discover
        from csd_pipeline.runtime.model_loading import model_fingerprint, resolve_device, resolve_model_source

        self.config = config
        self.output_dir = location(config.output)
        check_output_dir(self.output_dir)
        self.files = discover(config.corpus)
        path, gguf = resolve_model_source(config.model, trust_remote_code=config.trust_remote_code)
        self.model_path, self.gguf_file = path, gguf
        self.fingerprint = model_fingerprint(path, gguf)
        self.device_type = resolve_device(config.device).type

    def derived(self, world_size: int) -> dict:
        return {"device_type": self.device_type}

    def sources(self) -> dict:
        sources = {"model": {"fingerprint": self.fingerprint["sha256"]}, "inputs": [f.fingerprint() for f in self.files]}
        if self.config.mode == "chat":
            sources["chat_template"] = self.chat_template_record()
        return sources

    def chat_template_record(self) -> dict:
        """Where the student's chat template comes from and its sha256 (a changed template is a new run)."""
        from csd_pipeline.align.templates import load_chat_template
        from csd_pipeline.vocab.vocabulary import load_tokenizer

        bundle = load_tokenizer(str(self.model_path), trust_remote_code=self.config.trust_remote_code)
        template = load_chat_template(bundle, self.config.chat_template, "student")
        return {"file": self.config.chat_template, "sha256": template.sha256}

    def manifest_extra(self) -> dict:
        return {"sources": {"model": str((self.model_path / (self.gguf_file or "")).resolve())}}

    def plan(self, world_size: int, log) -> list[ShardTask]:
        refused: dict[str, int] = {}
        prompts = read_prompts(self.files, self.config, refused)
        if refused:
            log("chat records skipped: " + ", ".join(f"{reason} {n}" for reason, n in sorted(refused.items())))
        if not prompts:
            what = "chat record" if self.config.mode == "chat" else f"prompt (field {self.config.prompt_field!r})"
            raise CsdError(f"no usable {what} found in {', '.join(self.config.corpus)}; pass --prompt-field with the "
                           "field that holds the prompts, or --mode chat for records with `messages`.")
        log(f"planning {len(prompts)} prompts x {self.config.samples_per_prompt} samples...")
        size = self.config.prompts_per_shard
        return numbered_tasks([{"prompts": prompts[start:start + size]} for start in range(0, len(prompts), size)],
                              world_size)

    def shard_writer(self) -> GenerateShardWriter:
        return GenerateShardWriter(self.config, str(self.model_path / (self.gguf_file or "")))


def read_prompts(files, config: GenerateConfig, refused: dict | None = None) -> list[dict]:
    """Every usable prompt in corpus order: text mode {"source", "record_index", "prompt"[, "reference"]},
    chat mode {"source", "record_index", "record"[, "reference"]} (`chat_prompts.chat_prompt`); the
    reasons chat records were skipped are counted in `refused`."""
    from csd_pipeline.align.corpus import CorpusFile, ReadOptions, plan_shards, read_segment, segment_spec
    from csd_pipeline.generate.chat_prompts import chat_prompt

    chat = config.mode == "chat"
    options = ReadOptions(config.prompt_field, whole_record=chat)
    prompts = []
    refused = {} if refused is None else refused
    for segments in plan_shards(files, options, 1 << 62):
        for segment in segments:
            spec = segment_spec(files, segment)
            for document in read_segment(CorpusFile.from_spec(spec), spec, options):
                if not document.text:
                    continue
                if chat:
                    entry, reason = chat_prompt(document.source, document.record_index, document.text)
                    if entry is None:
                        refused[reason] = refused.get(reason, 0) + 1
                    else:
                        prompts.append(entry)
                    continue
                entry = {"source": document.source, "record_index": document.record_index, "prompt": document.text}
                if config.prompt_chars:
                    cut = _prefix_end(document.text, config.prompt_chars)
                    if cut == 0 or cut == len(document.text):
                        continue  # no whitespace to cut at, or nothing left to continue
                    entry["prompt"], entry["reference"] = document.text[:cut], document.text[cut:]
                prompts.append(entry)
    return prompts


def _prefix_end(text: str, chars: int) -> int:
    """The end of the prompt: the last whitespace at or before `chars` (the reference starts with it)."""
    if len(text) <= chars:
        return len(text)
    cut = chars
    while cut > 0 and text[cut] not in WHITESPACE:
        cut -= 1
    while cut > 0 and text[cut - 1] in WHITESPACE:
        cut -= 1
    return cut


class GenerateShardWriter:
    """Writes one shard of samples; picklable (each worker process loads its own student)."""

    def __init__(self, config: GenerateConfig, model: str):
        self.config = config
        self.model = model
        self._state = None  # (backend, tokenizer bundle, chat prompter or None), loaded on first use in this process

    def __getstate__(self):
        return {"config": self.config, "model": self.model, "_state": None}

    def _load(self):
        if self._state is None:
            from csd_pipeline.generate.backend import SamplingSettings
            from csd_pipeline.generate.chat_prompts import ChatPrompter
            from csd_pipeline.generate.transformers_backend import TransformersBackend
            from csd_pipeline.runtime.model_loading import load_causal_lm
            from csd_pipeline.teacher.shard_writer import deterministic_torch
            from csd_pipeline.vocab.vocabulary import load_tokenizer

            config = self.config
            loaded = load_causal_lm(self.model, dtype=config.dtype, device=config.device,
                                    trust_remote_code=config.trust_remote_code)
            deterministic_torch(str(loaded.device))
            bundle = load_tokenizer(str(loaded.path), trust_remote_code=config.trust_remote_code)
            roles = bundle.vocab.roles
            stops = tuple(sorted({roles[r] for r in ("eos", "eot") if r in roles}))
            pad = roles.get("pad", roles.get("eos", 0))
            settings = SamplingSettings(config.max_new_tokens, float(config.temperature), float(config.top_p), stops, pad)
            chat = ChatPrompter(bundle, config.chat_template) if config.mode == "chat" else None
            self._state = (TransformersBackend(loaded, settings), bundle, chat)
        return self._state

    def _prompt_ids(self, entry: dict) -> list[int]:
        """The ids the student continues: text mode, its context token + the prompt's tokens (no special token
        parsed); chat mode, the template's rendering up to the turn to write. Raises `ChatRefusal`."""
        _, bundle, chat = self._load()
        if chat is not None:
            return chat.prompt_ids(entry)
        context = bundle.vocab.context_token()
        ids = bundle.tokenizer.encode(entry["prompt"], add_special_tokens=False).ids
        return ([context] if context is not None else []) + list(ids)

    def __call__(self, task: ShardTask, tmp_path: Path) -> ShardResult:
        from csd_pipeline.align.chat_records import ChatRefusal
        from csd_pipeline.generate.backend import sample_seed

        backend, bundle, chat = self._load()
        config = self.config
        encoded, refused = {}, {}
        for entry in task.spec["prompts"]:
            try:
                encoded[(entry["source"], entry["record_index"])] = self._prompt_ids(entry)
            except ChatRefusal as refusal:
                refused[refusal.reason] = refused.get(refusal.reason, 0) + 1
        work = [(entry, sample) for entry in task.spec["prompts"] if (entry["source"], entry["record_index"]) in encoded
                for sample in range(config.samples_per_prompt)]
        stats = {"samples": 0, "finish": {"stop": 0, "length": 0}, "completion_tokens": 0, "empty_completions": 0}
        if chat is not None:
            stats["chat"] = {"refused_prompts": refused, "written_not_prefix": {}}
        with open(tmp_path, "w", encoding="utf-8", newline="\n") as handle:
            for start in range(0, len(work), config.batch_size):
                group = work[start:start + config.batch_size]
                prompts = [encoded[(entry["source"], entry["record_index"])] for entry, _ in group]
                seeds = [sample_seed(config.seed, e["source"], e["record_index"], s) for e, s in group]
                for (entry, sample), generation, prompt in zip(group, backend.generate(prompts, seeds), prompts,
                                                               strict=True):
                    completion = completion_text(bundle.vocab, generation.ids)
                    record = self._record(entry, sample, completion, generation, prompt, stats)
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                    stats["samples"] += 1
                    stats["finish"][generation.finish] += 1
                    stats["completion_tokens"] += len(generation.ids)
                    stats["empty_completions"] += not completion
        return ShardResult(rows=len(work), stats=stats)

    def _record(self, entry: dict, sample: int, completion: str, generation, prompt: list[int], stats: dict) -> dict:
        """One sample's JSON record (text: prompt/completion; chat: the record with the written turn)."""
        from csd_pipeline.generate.chat_prompts import written_record

        extra = {"source": entry["source"], "record_index": entry["record_index"], "sample": sample,
                 "finish": generation.finish, "completion_tokens": len(generation.ids)}
        _, _, chat = self._load()
        if chat is not None:
            record = written_record(entry, completion, extra)
            reason = chat.check_written(record, prompt)
            if reason is not None:
                counts = stats["chat"]["written_not_prefix"]
                counts[reason] = counts.get(reason, 0) + 1
            return record
        record = {"source": entry["source"], "record_index": entry["record_index"], "sample": sample,
                  "prompt": entry["prompt"], "completion": completion, "finish": generation.finish,
                  "completion_tokens": len(generation.ids)}
        if "reference" in entry:
            record["reference"] = entry["reference"]
        return record


def completion_text(vocab, ids: list[int]) -> str:
    """The text the ids spell (special tokens spell nothing); an incomplete UTF-8 character at the end
    (a sample cut by --max-new-tokens) is dropped, other invalid bytes become U+FFFD."""
    data = b"".join(vocab.token_bytes[i] for i in ids)
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the last character's first byte
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            if need > back:
                data = data[:-back]
            break
    return data.decode("utf-8", errors="replace")
