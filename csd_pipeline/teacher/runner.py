"""The teacher forward and its top-k: `TeacherRunner` turns rows of teacher ids into `TeacherTopkRow`s.

- Rows are sorted by length and batched under a token budget (`plan_batches`), right-padded, with
  the padding masked; the batches are a pure function of the rows and the budget.
- The decoder's last hidden states of the real positions go through the output layer in float32,
  a chunk of positions at a time (a bf16 GPU teacher still gets float32 logits and log-softmax, and
  memory stays bounded by the chunk). A head that is not a plain linear layer, or whose logits this
  path does not reproduce on a short probe, falls back to the model's own forward.
- Log-softmax over the model's whole output; ids at or beyond the tokenizer size (padded rows) are
  kept out of the top-k after the normalisation.
- With `top_p`, each position keeps only its most likely entries until their probabilities reach
  `top_p` (at most `top_k`; `mass_lengths`); with `min_p`, only the entries at least `min_p` times as
  likely as its most likely one (`relative_lengths`); with both, the fewer. `TeacherTopkRow.lengths` says how many.
- With `tail_samples` N, each position also stores N draws from the rest of its distribution, each at
  an estimate of its probability (`tail_samples.py`), from the generator `seed` sets (0 if never set).
- A row with any non-finite value is marked (`finite=False`) for the stage to reject.
- On a GPU an out-of-memory batch is split in two and retried.
"""

from __future__ import annotations

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.row import TeacherTopkRow
from schemas.teacher_topk import RowStatus

LOGIT_CHUNK_ELEMENTS = 1 << 25  # float32 logits held at once: 128 MiB
PROBE_TOKENS = 16


def mass_lengths(logprobs: np.ndarray, top_p: float) -> np.ndarray:
    """Per position, the smallest n whose n most likely entries hold probability >= top_p, at most k.

    logprobs: float [P, k], each row descending (a top-k). Probabilities are summed in float64. The
    first entry always counts (n >= 1); where the k entries hold less than top_p, n = k.
    """
    probs = np.exp(np.asarray(logprobs, dtype=np.float64))
    before = np.zeros_like(probs)  # the mass of the entries more likely than each one
    np.cumsum(probs[:, :-1], axis=1, out=before[:, 1:])
    return np.maximum(np.count_nonzero(before < top_p, axis=1), 1).astype(np.int64)


def relative_lengths(logprobs: np.ndarray, min_p: float) -> np.ndarray:
    """Per position, how many entries are at least `min_p` times as likely as the most likely one
    (log-prob >= the first's + log(min_p), compared in float64), at least 1.

    logprobs: float [P, k], each row descending (a top-k). A flat position keeps many entries, a
    peaked one few: the same log-ratio below the top entry everywhere.
    """
    values = np.asarray(logprobs, dtype=np.float64)
    floor = values[:, :1] + np.log(min_p)
    return np.maximum(np.count_nonzero(values >= floor, axis=1), 1).astype(np.int64)


def kept_lengths(logprobs: np.ndarray, top_p: float | None, min_p: float | None) -> np.ndarray | None:
    """The entries each position keeps under `--top-p` and `--min-p` (the fewer of the two; None: all)."""
    kept = None if top_p is None else mass_lengths(logprobs, top_p)
    if min_p is not None:
        relative = relative_lengths(logprobs, min_p)
        kept = relative if kept is None else np.minimum(kept, relative)
    return kept


def plan_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Group row indices into batches: longest first, each batch's rows x longest row <= batch_tokens
    (a row longer than the budget goes alone). A pure function of (lengths, batch_tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


class TeacherRunner:
    """Computes `TeacherTopkRow`s for rows of teacher token ids with a loaded model (`LoadedModel`).

    vocab_limit: the teacher tokenizer's size; ids >= vocab_limit never enter the top-k. top_p: keep
    only the most likely entries of each position until they hold this probability (None: all top_k);
    min_p: keep only the entries at least this many times as likely as the position's most likely one;
    tail_samples: also store this many draws from the rest of each position's distribution (sample_seed:
    what `tail_samples.block_seed` derives each block's generator from).
    """

    def __init__(self, loaded, *, top_k: int, vocab_limit: int, batch_tokens: int, temperature: float = 1.0,
                 top_p: float | None = None, min_p: float | None = None, tail_samples: int = 0,
                 sample_seed: int = 0, logit_chunk_elements: int = LOGIT_CHUNK_ELEMENTS):
        import torch

        self.loaded = loaded
        self.model = loaded.model.eval()
        self.device = loaded.device
        self.top_k = top_k
        self.vocab_limit = vocab_limit
        self.output_size = loaded.output_size
        if vocab_limit > self.output_size:
            raise ValueError("vocab_limit exceeds the model's output size")
        if top_k > vocab_limit:
            raise CsdError(f"--top-k {top_k} is larger than the teacher vocabulary ({vocab_limit}); pass a smaller --top-k.")
        self.temperature = temperature
        self.top_p = top_p
        self.min_p = min_p
        self.tail_samples = int(tail_samples)
        self.sample_seed = int(sample_seed)
        self._generator = None
        self.batch_tokens = batch_tokens
        self.chunk = max(1, logit_chunk_elements // self.output_size)
        self._head = None
        self.path = "forward"
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        base = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if isinstance(head, torch.nn.Linear) and base is not None and base is not self.model:
            self._base = base
            weight = head.weight.detach()
            bias = None if head.bias is None else head.bias.detach()
            # float32 output layer: a bf16 teacher still gets float32 logits (one copy of the head).
            self._head = (weight.float(), None if bias is None else bias.float())
            config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
            self._softcap = getattr(config, "final_logit_softcapping", None)
            self._scale = getattr(config, "logit_scale", None)
            self._scaling = getattr(config, "logits_scaling", None)
            self.path = "hidden+head" if self._probe_matches() else "forward"
            if self.path == "forward":
                self._head = None

    @property
    def width(self) -> int:
        """Entries a position can hold: the top-k, and with tail samples the draws and the observed token."""
        return self.top_k + (self.tail_samples + 1 if self.tail_samples else 0)

    # -- logits ----------------------------------------------------------------------------

    def _head_logits(self, hidden):
        import torch

        weight, bias = self._head
        logits = torch.nn.functional.linear(hidden.float(), weight, bias)
        if self._scale not in (None, 1, 1.0):
            logits = logits * float(self._scale)
        if self._scaling not in (None, 1, 1.0):
            logits = logits / float(self._scaling)
        if self._softcap:
            logits = torch.tanh(logits / float(self._softcap)) * float(self._softcap)
        return logits

    def _probe_matches(self) -> bool:
        """Check once that hidden states + head reproduce the model's own logits on a short probe."""
        import torch

        ids = torch.arange(min(PROBE_TOKENS, self.vocab_limit), device=self.device)[None, :]
        with torch.inference_mode():
            reference = self.model(input_ids=ids, use_cache=False).logits[0].float()
            try:
                hidden = self._base(input_ids=ids, use_cache=False).last_hidden_state[0]
                mine = self._head_logits(hidden)
            except (TypeError, AttributeError, ValueError, RuntimeError):
                return False  # a base model with another interface: use the model's own forward
        if mine.shape != reference.shape:
            return False
        low_precision = self.loaded.dtype in (torch.bfloat16, torch.float16)
        tolerance = (2e-2 if low_precision else 1e-3) * (1.0 + reference.abs())
        return bool(((mine - reference).abs() <= tolerance).all())

    def _batch_tensors(self, rows: list[np.ndarray]):
        import torch

        width = max(len(r) for r in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
            mask[b, : len(row)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def _batch_topk(self, rows: list[np.ndarray]) -> list[TeacherTopkRow]:
        import torch

        input_ids, mask = self._batch_tensors(rows)
        lengths = [len(r) for r in rows]
        width = input_ids.shape[1]
        flat = torch.cat([torch.arange(n, device=self.device) + b * width for b, n in enumerate(lengths)])
        next_ids = torch.from_numpy(np.concatenate(
            [np.append(np.asarray(r[1:], dtype=np.int64), -1) for r in rows])).to(self.device)
        with torch.inference_mode():
            if self._head is not None:
                states = self._base(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
                states = states.reshape(-1, states.shape[-1])[flat]
            else:
                logits_all = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
                states = logits_all.reshape(-1, logits_all.shape[-1])[flat]
            ids_out, lp_out, obs_out, ok_out, draws_out, tail_out, kept_out = [], [], [], [], [], [], []
            for start in range(0, states.shape[0], self.chunk):
                part = states[start:start + self.chunk]
                logits = self._head_logits(part) if self._head is not None else part.float()
                if self.temperature != 1.0:
                    logits = logits / self.temperature
                # Padded rows (ids >= tokenizer size) never enter the top-k ...
                candidates = logits if self.vocab_limit == logits.shape[-1] else logits[:, : self.vocab_limit]
                values, indices = torch.topk(candidates, self.top_k, dim=-1)
                nxt = next_ids[start:start + part.shape[0]]
                observed = logits.gather(1, nxt.clamp(min=0)[:, None])[:, 0]
                # ... but the normaliser covers the whole output: log-sum-exp, shifted by the row maximum,
                # in place (twice as fast as torch.logsumexp on CPU). A NaN or inf logit makes it NaN.
                peak = values[:, 0] if candidates is logits else logits.amax(dim=-1)
                lse = peak + torch.log(logits.sub_(peak[:, None]).exp_().sum(dim=-1))
                logprobs = values - lse[:, None]
                observed = torch.where(nxt >= 0, observed - lse, torch.full_like(observed, float("nan")))
                ok = torch.isfinite(lse) & torch.isfinite(logprobs).all(dim=1) & (torch.isfinite(observed) | (nxt < 0))
                ids_out.append(indices.to(torch.int32).cpu())
                lp_out.append(logprobs.cpu())
                obs_out.append(observed.cpu())
                ok_out.append(ok.cpu())
                if self.tail_samples:  # `logits` holds exp(logit - peak) now
                    draws, log_tail, kept = self._draw_tail(logits, indices, logprobs, nxt, torch.exp(lse - peak))
                    draws_out.append(draws.cpu())
                    tail_out.append(log_tail.cpu())
                    kept_out.append(kept)
        ids_all = torch.cat(ids_out).numpy()
        lp_all = torch.cat(lp_out).numpy()
        obs_all = torch.cat(obs_out).numpy()
        ok_all = torch.cat(ok_out).numpy()
        if not self.tail_samples:
            kept = kept_lengths(lp_all, self.top_p, self.min_p)
        else:  # the kept counts the draws were made around, chunk by chunk
            from csd_pipeline.teacher.tail_samples import merge_tail

            kept = np.concatenate(kept_out)
            ids_all, lp_all, kept = merge_tail(ids_all, lp_all, kept, torch.cat(draws_out).numpy(),
                                               torch.cat(tail_out).numpy(), next_ids.cpu().numpy(), obs_all)
        results, offset = [], 0
        for n in lengths:
            part = slice(offset, offset + n)
            status = RowStatus.OK if ok_all[part].all() else RowStatus.NON_FINITE
            results.append(TeacherTopkRow(None, ids_all[part], lp_all[part], obs_all[part], int(status),
                                          None if kept is None else kept[part]))
            offset += n
        return results

    def _draw_tail(self, weights, indices, logprobs, next_ids, total):
        """`tail_samples.draw_tail` for one chunk of positions, around their kept counts (`kept_lengths`; all
        top_k without a cut). Returns (draws, log_tail, kept int64 numpy [P])."""
        import torch

        from csd_pipeline.teacher.tail_samples import draw_tail

        kept = kept_lengths(logprobs.cpu().numpy(), self.top_p, self.min_p)
        kept = np.full(indices.shape[0], self.top_k, np.int64) if kept is None else kept
        if self._generator is None:
            self.seed(0)
        draws, log_tail = draw_tail(weights, indices, torch.from_numpy(kept).to(indices.device), next_ids, total,
                                    self.tail_samples, self._generator, self.vocab_limit)
        return draws, log_tail, kept

    def seed(self, seed: int) -> None:
        """Seed the generator of the tail draws (`tail_samples.block_seed` per block of rows)."""
        import torch

        self._generator = torch.Generator(device=self.device).manual_seed(int(seed))

    def _run_batch(self, rows: list[np.ndarray]) -> list[TeacherTopkRow]:
        import torch

        try:
            return self._batch_topk(rows)
        except torch.OutOfMemoryError:
            if self.device.type != "cuda":
                raise
            torch.cuda.empty_cache()
            if len(rows) == 1:
                raise CsdError(
                    f"one teacher row of {len(rows[0])} tokens does not fit in GPU memory even alone; align with a "
                    "smaller --max-teacher-tokens or use a larger GPU."
                ) from None
            half = len(rows) // 2  # split and retry: an OOM batch is never fatal
            return self._run_batch(rows[:half]) + self._run_batch(rows[half:])

    def run(self, rows: list[np.ndarray]) -> list[TeacherTopkRow]:
        """The `TeacherTopkRow` of every row (int teacher ids, each non-empty), in the given order."""
        from csd_pipeline.runtime import progress

        results: list[TeacherTopkRow | None] = [None] * len(rows)
        for batch in plan_batches([len(r) for r in rows], self.batch_tokens):
            for index, result in zip(batch, self._run_batch([rows[i] for i in batch])):
                results[index] = result
            progress.advance(len(batch))
        return results
