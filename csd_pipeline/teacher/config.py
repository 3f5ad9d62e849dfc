"""`TeacherLogitsConfig`: the options of `csd-pipeline teacher-logits`, each with its one default and help.

The click command (`cli/teacher_logits.py`) builds its flags from these fields. The fields marked
`selector=True` are the options of the store's selectors (`teacher/store/selectors/`), which check them
(`Selector.check_options`) and read them (`from_config`); the command offers each as a flag, in field order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.model_loading import DTYPES
from csd_pipeline.runtime.options import option

KEEP_CHOICES = ("top-k", "csd-events")
"""`--keep`: every entry of the (mass-adaptive) top-k, or only those the CSD loss turns into events
with the aligned directory's tables (`teacher/store/selectors/csd_events.py`)."""


@dataclass
class TeacherLogitsConfig:
    """Options of `csd-pipeline teacher-logits`."""

    aligned: str = option(help="Output directory of `csd-pipeline align`.")
    # keyword-only, so that it may default to "" (a served teacher, --teacher-server, needs none) before `output`
    teacher: str = field(default="", kw_only=True, metadata={
        "help": "The teacher model: a local Hugging Face folder, a GGUF file, a hub name or a fixture name (or "
                "--teacher-server)."})
    output: str = option(help="Output directory (resumable).")
    teacher_index: int = option(0, "Which teacher of the aligned directory this model is (its teacher{i}_ids column).")
    top_k: int = option(32, "Entries kept per position (with --top-p: at most this many).", selector=True)
    top_p: float | None = option(
        None, "Mass-adaptive top-k: keep each position's most likely entries until their probabilities reach "
              "this mass (e.g. 0.99), at most --top-k of them (default: always --top-k).", selector=True)
    min_p: float | None = option(
        None, "Relative cut: keep only the entries at least this many times as likely as the position's most likely "
              "one (e.g. 0.005), at most --top-k of them: flat positions keep many, peaked ones few.", selector=True)
    tail_samples: int = option(
        0, "Also store this many draws from the rest of each position's distribution (outside the kept entries), "
           "each at an estimate of its probability, so the stored entries carry the teacher's whole mass in "
           "expectation (CSD losses only; e.g. 32).", selector=True)
    sample_seed: int = option(0, "Seed of the --tail-samples draws (with each block's first row id).", selector=True)
    keep: str = option(
        "top-k", "Which of those entries to store: top-k (all of them; every loss reads them) or csd-events (only "
                 "those the CSD loss turns into events with the aligned tables: the same CSD training from about 30% "
                 "fewer bytes, but the baseline losses cannot read it).", choices=KEEP_CHOICES,
        selector=True)
    batch_tokens: int = option(8192, "Token budget of one forward batch, padding included (rows are batched by length).")
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N.")
    dtype: str = option("auto", "Teacher weights: auto = float32 on CPU, bfloat16 on GPU. Logits and log-softmax are "
                                "always float32.", choices=DTYPES)
    temperature: float = option(1.0, "Capture temperature: the logits are divided by it before the log-softmax.")
    trust_remote_code: bool = option(False, "Allow the model repository's own code (off by default).")
    block_positions: int = option(1 << 16, "Positions per encoded block (one Parquet row group); bigger compresses "
                                           "slightly better.")
    teacher_server: str | None = option(
        None, "Instead of --teacher: the URL of an OpenAI-compatible server that returns prompt log-probabilities of "
              "token-id prompts (vLLM; e.g. http://127.0.0.1:8000); it receives each row's exact teacher ids.")
    teacher_model: str | None = option(None, "With --teacher-server: the name the server serves the teacher under.")
    server_top_k: int | None = option(
        None, "With --teacher-server and --tail-samples: entries asked of the server per position, more than --top-k "
              "(at most its logprobs limit); the draws come from those beyond the kept ones, and the mass beyond all "
              "of them stays in REST (default: --top-k).")
    server_concurrency: int = option(8, "With --teacher-server: requests in flight at once.")
    server_timeout: float = option(600.0, "With --teacher-server: seconds to wait for one answer before failing.")
    check_tokenizer: bool = option(True, "Do not compare the teacher folder's tokenizer.json with the aligned teacher "
                                         "tokenizer.")

    def validate(self) -> None:
        """Raise CsdError naming the option that is out of range."""
        from csd_pipeline.teacher.store.selectors import check_options

        check_options(self)  # each selector's options (`selector=True` fields), in its own file
        if self.teacher_server:
            from csd_pipeline.teacher.served import check_served_options

            check_served_options(self)
        elif not self.teacher:
            raise CsdError("no teacher: pass --teacher (a model folder, GGUF file or fixture name) or --teacher-server "
                           "URL with --teacher-model NAME.")
        elif self.server_top_k is not None:
            raise CsdError(f"--server-top-k {self.server_top_k} is what a served teacher is asked for; drop it (the "
                           f"in-process --teacher {self.teacher} draws --tail-samples from its whole distribution).")
        if self.batch_tokens < 1:
            raise CsdError(f"--batch-tokens {self.batch_tokens} is not positive; pass e.g. {TeacherLogitsConfig.batch_tokens}.")
        if not self.temperature > 0:
            raise CsdError(f"--temperature {self.temperature} is not positive; pass e.g. {TeacherLogitsConfig.temperature}.")
        if self.teacher_index < 0:
            raise CsdError(f"--teacher-index {self.teacher_index} is negative; pass 0 for the first teacher.")
        if self.block_positions < 1:
            raise CsdError(f"--block-positions {self.block_positions} is not positive.")
