"""The teacher forward and its top-k: `TeacherRunner` turns rows of teacher ids into `TeacherTopkRow`s.

- Rows are sorted by length and batched under a token budget (`plan_batches`), right-padded, with
  the padding masked; the batches are a pure function of the rows and the budget.
- The decoder's last hidden states of the real positions go through the output layer in float32,
  a chunk of positions at a time (a bf16 GPU teacher still gets float32 logits and log-softmax, and
  memory stays bounded by the chunk). A head that is not a plain linear layer, or whose logits this
  path does not reproduce on a short probe, falls back to the model's own forward.
- Log-softmax over the model's whole output; ids at or beyond the tokenizer size (padded rows) are
  kept out of the top-k after the normalisation.
- Each chunk of positions then goes through the store's position selectors (`store/selectors/`: top-k, top-p,
  min-p, tail samples), in order; `TeacherTopkRow.lengths` says how many entries each position keeps. A
  selector that reads the whole distribution (tail samples) gets it (`Distribution`) with the generator `seed`
  sets (0 if never set).
- A row with any non-finite value is marked (`finite=False`) for the stage to reject.
- On a GPU an out-of-memory batch is split in two and retried.
"""

from __future__ import annotations

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.store.schema import RowStatus
from csd_pipeline.teacher.store.selectors import Distribution, Entries

LOGIT_CHUNK_ELEMENTS = 1 << 25  # float32 logits held at once: 128 MiB
PROBE_TOKENS = 16


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

    top_k: the entries the forward takes per position; vocab_limit: the teacher tokenizer's size (ids >=
    vocab_limit never enter the top-k); selectors: the store's position selectors (`SelectorChain.
    position_selectors()`), applied to each chunk in order (default: `TopK(top_k)` alone).
    """

    def __init__(self, loaded, *, top_k: int, vocab_limit: int, batch_tokens: int, temperature: float = 1.0,
                 selectors: tuple | None = None, logit_chunk_elements: int = LOGIT_CHUNK_ELEMENTS):
        import torch

        from csd_pipeline.teacher.store.selectors import SelectorChain, TopK

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
        self.selectors = tuple(selectors) if selectors is not None else (TopK(top_k),)
        self._draws = any(selector.needs_distribution for selector in self.selectors)
        self._generator = None
        self.chain = SelectorChain(self.selectors)
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
        """Entries a position can hold after the selectors (with tail samples: the draws and the observed token)."""
        return self.chain.width

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
            entries_out, ok_out = [], []
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
                ok_out.append(ok.cpu())
                entries = Entries(indices.to(torch.int32).cpu().numpy(), logprobs.cpu().numpy(),
                                  np.full(part.shape[0], self.top_k, np.int64), observed.cpu().numpy(),
                                  nxt.cpu().numpy())
                distribution = None
                if self._draws:  # `logits` holds exp(logit - peak) now
                    if self._generator is None:
                        self.seed(0)
                    distribution = Distribution(logits, torch.exp(lse - peak), indices, nxt, self.vocab_limit,
                                                self._generator)
                for selector in self.selectors:
                    entries = selector.cut(entries, distribution)
                entries_out.append(entries)
        ok_all = torch.cat(ok_out).numpy()
        ids_all = np.concatenate([e.ids for e in entries_out])
        lp_all = np.concatenate([e.logprobs for e in entries_out])
        kept = np.concatenate([e.lengths for e in entries_out])
        obs_all = np.concatenate([e.observed for e in entries_out])
        results, offset = [], 0
        for n in lengths:
            part = slice(offset, offset + n)
            status = RowStatus.OK if ok_all[part].all() else RowStatus.NON_FINITE
            results.append(TeacherTopkRow(None, ids_all[part], lp_all[part], obs_all[part], int(status), kept[part]))
            offset += n
        return results

    def seed(self, seed: int) -> None:
        """Seed the generator of the selectors' draws (`SelectorChain.block_seed` per block of rows)."""
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
