"""The teacher-logits stage: run the teacher once over the aligned shards, keep its top-k.

It reads as runner -> selectors -> writer: for every teacher position of every aligned row the
runner (`runner.py`) takes the top-k token ids and their log-probabilities under the softmax over
the model's whole output, the store's selectors (`store/selectors/`, built once from the options:
top-k, top-p, min-p, tail samples, CSD events) choose which entries to keep, and the store's writer
(`store/writer.py`) encodes them with the log-probability of the observed next token (SPEC §6), in
Parquet shards co-partitioned with the aligned shards (`csd_pipeline/teacher/store/schema.py`).

`TeacherLogitsStage(config)` opens the aligned output (`AlignedOutput`), checks the output
directory, loads the teacher and checks it against the aligned teacher tokenizer, then declares
what the shared executor needs:

- identity: the capture settings (each selector declares its part, then `RECORDED`), the teacher's
  fingerprint and sizes, the aligned manifest's sha256;
- plan: one task per aligned shard, with the same name (co-partitioning);
- shard writer: `TeacherShardWriter` (`shard_writer.py`): aligned shard -> runner -> selectors -> writer.

`run_teacher_logits(config)` runs it for this rank; ranks (torchrun / SLURM / --rank) take
disjoint shards, and the rank that completes last (or `csd-pipeline status DIR --finalize`)
writes the manifest.
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.executor import ShardTask, Stage, check_output_dir, run_configured
from csd_pipeline.runtime.storage import location
from csd_pipeline.teacher.config import TeacherLogitsConfig
from csd_pipeline.teacher.shard_writer import TeacherShardWriter, deterministic_torch, teacher_runner
from csd_pipeline.teacher.store.schema import SCHEMA_VERSION, STAGE

# The capture settings the identity's "config" records after the selectors' part, in this order.
RECORDED = ("encoding", "logprob_step", "max_abs_error", "temperature", "dtype", "logits_dtype", "device_type",
            "batch_tokens", "block_positions", "teacher_index")


def run_teacher_logits(config: TeacherLogitsConfig, *, rank: int | None = None, world_size: int | None = None,
                       workers: int = 1, engine=None, log=None):
    """Run (or resume) the teacher-logits stage for this rank (engine: the `EngineConfig`, default local);
    returns the executor's `RunReport`.

    Raises CsdError for a bad option, an aligned directory without a (known) manifest, a teacher
    that does not match the aligned teacher tokenizer, or an unwritable output directory.
    """
    return run_configured(config, lambda: TeacherLogitsStage(config, log), rank=rank, world_size=world_size,
                          workers=workers, engine=engine, log=log)


class TeacherLogitsStage(Stage):
    """The teacher-logits stage of one `TeacherLogitsConfig`, its teacher loaded and checked."""

    name = STAGE
    schema_version = SCHEMA_VERSION
    work_unit = "row"

    def __init__(self, config: TeacherLogitsConfig, log=None):
        from dataclasses import asdict

        from csd_pipeline.align.output import AlignedOutput
        from csd_pipeline.runtime.model_loading import load_causal_lm, resolve_device, resolve_dtype
        from csd_pipeline.teacher.store.selectors import chain_from_config

        log = log or (lambda message: None)
        self.config = config
        self.aligned = AlignedOutput.open(config.aligned)
        self.tokenizer = self.aligned.teacher_tokenizer(config.teacher_index)
        self.output_dir = location(config.output)
        self.chain = chain_from_config(asdict(config), self.aligned)
        check_output_dir(self.output_dir)  # before the teacher is loaded, which may take minutes
        if config.teacher_server:
            self._serve(log)
            return
        self.device = resolve_device(config.device)
        self.dtype = str(resolve_dtype(config.dtype, self.device)).replace("torch.", "")
        deterministic_torch(str(self.device))
        log(f"loading teacher {config.teacher} ({self.dtype} on {self.device})...")
        self.loaded = load_causal_lm(config.teacher, dtype=self.dtype, device=str(self.device),
                                     trust_remote_code=config.trust_remote_code)
        self._check_teacher(log)
        self.runner = teacher_runner(self.loaded, config, self.chain, self.tokenizer.size)

    def _serve(self, log) -> None:
        """The teacher is a server (--teacher-server): nothing is loaded here; the server must list the model."""
        from csd_pipeline.teacher.served import served_teacher

        self.loaded = None
        self.dtype = "served"
        log(f"teacher {self.config.teacher_model} served at {self.config.teacher_server}")
        self.runner = served_teacher(self.config, self.chain, self.tokenizer.size)
        self.device = self.runner.device

    def _check_teacher(self, log) -> None:
        """Refuse a teacher with fewer outputs than the aligned teacher tokenizer has ids, or whose own
        tokenizer is not the one the aligned directory used."""
        config, loaded, tokenizer = self.config, self.loaded, self.tokenizer
        where = f"teacher tokenizer {config.teacher_index} of {self.aligned.directory}"
        if loaded.output_size < tokenizer.size:
            raise CsdError(
                f"teacher {config.teacher} has {loaded.output_size} outputs but {where} ({tokenizer.name}) has "
                f"{tokenizer.size} ids; pass the teacher that goes with that tokenizer, or re-run csd-pipeline align "
                "with this teacher's tokenizer."
            )
        if not config.check_tokenizer:
            return
        if loaded.gguf_file is not None or not (loaded.path / "tokenizer.json").is_file():
            log(f"teacher {loaded.source} carries no tokenizer.json; only its output size was checked.")
            return
        from csd_pipeline.vocab.vocabulary import load_tokenizer

        fingerprint = load_tokenizer(str(loaded.path)).vocab.fingerprint
        if fingerprint != tokenizer.fingerprint:
            raise CsdError(
                f"teacher {loaded.source} has another tokenizer ({fingerprint[:12]}) than teacher "
                f"{config.teacher_index} of {self.aligned.directory} ({str(tokenizer.fingerprint)[:12]}, "
                f"{tokenizer.name}); pass the matching teacher or --teacher-index, or re-run csd-pipeline align "
                "with this teacher's tokenizer."
            )

    @property
    def recorded(self) -> tuple[str, ...]:
        """Each selector's part (recorded only when set: earlier outputs keep theirs), then `RECORDED`."""
        return (*self.chain.identity(), *RECORDED)

    def derived(self, world_size: int) -> dict:
        from csd_pipeline.teacher.store.codec import ENCODING, MAX_ABS_ERROR, STEPS_PER_NAT

        return {**self.chain.identity(), "encoding": ENCODING, "logprob_step": 1 / STEPS_PER_NAT,
                "max_abs_error": MAX_ABS_ERROR, "temperature": float(self.config.temperature), "dtype": self.dtype,
                "logits_dtype": "float32", "device_type": self.device.type}

    def sources(self) -> dict:
        if self.loaded is None:  # served: the model's name, not the URL (a restarted server may move)
            teacher = {"served_model": self.config.teacher_model, "tokenizer_fingerprint": self.tokenizer.fingerprint,
                       "tokenizer_size": self.tokenizer.size}
            if self.config.server_top_k:  # the draws' reach (--tail-samples); recorded only when set
                teacher["server_top_k"] = int(self.config.server_top_k)
            return {"teacher": teacher, "aligned": {"manifest_sha256": self.aligned.manifest_sha256(),
                                                    "shards": len(self.aligned.shards)}}
        return {
            "teacher": {
                "fingerprint": self.loaded.fingerprint["sha256"],
                "files": self.loaded.fingerprint["files"],
                "output_size": self.loaded.output_size,
                "tokenizer_fingerprint": self.tokenizer.fingerprint,
                "tokenizer_size": self.tokenizer.size,
            },
            "aligned": {"manifest_sha256": self.aligned.manifest_sha256(), "shards": len(self.aligned.shards)},
        }

    def manifest_extra(self) -> dict:
        # Recorded in run.json too, so it must not change between re-runs: absolute paths (a served model's name).
        if self.loaded is None:
            return {"sources": {"aligned": str(self.aligned.directory.resolve()),
                                "teacher": f"served:{self.config.teacher_model}",
                                "teacher_tokenizer": self.tokenizer.name}}
        teacher = self.loaded.path.resolve() / (self.loaded.gguf_file or "")
        return {"sources": {"aligned": str(self.aligned.directory.resolve()), "teacher": str(teacher),
                            "teacher_tokenizer": self.tokenizer.name}}

    def plan(self, world_size: int, log) -> list[ShardTask]:
        """One task per aligned shard, named like it (the two outputs are co-partitioned)."""
        return [ShardTask(index, Path(shard.file).stem,
                          {"aligned_file": shard.file, "aligned_sha256": shard.sha256, "rows": shard.rows})
                for index, shard in enumerate(self.aligned.shards)]

    def work(self, spec: dict) -> int:
        """The aligned rows of the shard: the teacher runner advances the bar by each batch of rows."""
        return spec["rows"]

    def shard_writer(self) -> TeacherShardWriter:
        return TeacherShardWriter(self.config, self.chain, self.aligned, self.tokenizer.size, str(self.device),
                                  self.dtype, self.runner)
