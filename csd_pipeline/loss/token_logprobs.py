"""Student log-probabilities at requested (position, token) pairs, without a [positions x vocab] tensor.

`chunked_token_logprobs(hidden, weight, positions, tokens)` computes log softmax(h W^T)[p, t] for the
requested pairs one *block* of logits at a time: the requested positions go in row chunks
(`chunk_size` rows, default 2,048) and the vocabulary in column blocks (`vocab_block` ids, default
about 2^24 logits per block, 8,192 ids at V = 128k), so every matrix product is a wide one (a row
chunk against a vocabulary block: on a CPU the product of 261 rows against the whole 128k head ran
about 20% slower per row than 2,048 rows against 8,192 ids). The forward takes each row's
logsumexp across the blocks as it goes (a running max and a rescaled sum); the backward forms the
blocks again (as fused LM-head losses do) and accumulates the gradients of h and of W block by block.
Only h, W and one logsumexp per position are saved, plus, within `reuse_bytes`, what the backward
needs of the first rows' softmax: the backward reuses it instead of recomputing the block (one
matrix product of the three per block), so memory buys speed. A kept block is stored as z - m,
the logits less the block's own row maxima (with m - logsumexp, one number per row and block, the
backward rebuilds log p exactly), in `reuse_dtype`: "float32" (the default; float64 for float64
inputs) or "float16" / "bfloat16", half the bytes, so twice the rows fit in the same budget. Rounding
z - m (|z - m| <= |log p|, since m <= logsumexp; m - logsumexp is kept as (m - the row's max) -
log sum exp(z - max), exact for the block holding the max even where log p is below float rounding
of the logits) to a 16-bit float with unit roundoff u (2^-11 for
float16, 2^-8 for bfloat16) changes each probability by a factor within exp(+-u |log p|), so the
softmax row's L1 error is at most about u x its entropy in nats: small where the gradient
1[t] - p cancels (p near 1, log p near 0) and relative error bounded for tiny probabilities (no
underflow above log p = -65,504). The backward turns a kept block back into the accumulation dtype
one block at a time, so it holds no more than one block beside what is kept.
`dense_token_logprobs(logits, positions, tokens)` does the same from materialised logits (tests,
small models). The CSD loss (`loss.csd`) and held-out bits per byte gather from these.

torch is imported inside functions so that importing this module is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from csd_pipeline.errors import CsdError

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_CHUNK_SIZE = None  # auto: 2,048 rows (more when the vocabulary is small; see auto_chunk_size)
DEFAULT_REUSE_BYTES = 0  # logits kept from forward for backward: none (the least memory)
REUSE_DTYPES = ("float32", "bfloat16", "float16")  # how kept blocks are stored (see the module docstring)
DEFAULT_REUSE_DTYPE = "float32"
REUSE_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # u of the 16-bit kept values
_AUTO_ROWS = 2048
_AUTO_BLOCK_ELEMENTS = 1 << 24  # logits per block: 64 MiB in float32


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses accumulate log-probabilities in: float64 for float64 inputs, float32 otherwise."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


class _Layout:
    """Where each request goes: unique positions (rows), row chunks and vocabulary blocks.

    Requests are reordered by (row chunk, vocabulary block), stably, so the ones a block answers are
    one slice: `span(chunk, block)`. `order[i]` is the original index of reordered request i,
    `row[i]` its row (index into `unique_pos`) and `token[i]` its token id. The first `kept_rows`
    rows are the ones whose blocks the forward keeps; a row chunk never straddles that boundary."""

    def __init__(self, positions, tokens, chunk_size: int, vocab_size: int, vocab_block: int, kept_rows: int):
        import torch

        by_position = torch.argsort(positions, stable=True)
        self.unique_pos, counts = torch.unique_consecutive(positions[by_position], return_counts=True)
        rows = self.unique_pos.numel()
        self.kept_rows = min(kept_rows, rows)
        self.chunks = [(a, min(a + chunk_size, stop)) for start, stop in ((0, self.kept_rows), (self.kept_rows, rows))
                       for a in range(start, stop, chunk_size)]
        self.blocks = [(v, min(v + vocab_block, vocab_size)) for v in range(0, vocab_size, vocab_block)]
        device = positions.device
        row = torch.repeat_interleave(torch.arange(rows, device=device), counts)
        starts = torch.tensor([a for a, _ in self.chunks], dtype=torch.int64, device=device)
        key = (torch.searchsorted(starts, row, right=True) - 1) * len(self.blocks) + tokens[by_position] // vocab_block
        regroup = torch.argsort(key, stable=True)
        self.order, self.row = by_position[regroup], row[regroup]
        self.token = tokens[self.order]
        ends = torch.cumsum(torch.bincount(key, minlength=len(self.chunks) * len(self.blocks)), 0)
        self._ends = [0] + ends.cpu().tolist()  # one host sync per call, not one per block

    def span(self, chunk: int, block: int) -> tuple[int, int]:
        """The reordered requests of row chunk `chunk` whose tokens lie in vocabulary block `block`."""
        k = chunk * len(self.blocks) + block
        return self._ends[k], self._ends[k + 1]


def _chunk_logits(hidden_rows, weight_block, acc_dtype):
    logits = hidden_rows @ weight_block.T
    return logits if logits.dtype == acc_dtype else logits.to(acc_dtype)


def _keep_torch_dtype(reuse_dtype: str):
    """The torch dtype of kept 16-bit log-probabilities; None for "float32" (exponentiated logits)."""
    import torch

    if reuse_dtype not in REUSE_DTYPES:
        raise CsdError(f"reuse_dtype must be one of {', '.join(REUSE_DTYPES)}, got {reuse_dtype!r}; "
                       "set --loss-reuse-dtype to one of them.")
    return None if reuse_dtype == "float32" else getattr(torch, reuse_dtype)


def _chunked_forward(ctx, hidden, weight, positions, tokens, chunk_size, vocab_block, reuse_bytes, reuse_dtype):
    """Forward of `ChunkedTokenLogprobs`: the gathered log-probabilities, a block of logits at a time."""
    import torch

    acc = accumulation_dtype(hidden.dtype)
    keep_as = _keep_torch_dtype(reuse_dtype) or acc
    row_bytes = weight.shape[0] * keep_as.itemsize
    layout = _Layout(positions, tokens, chunk_size, weight.shape[0], vocab_block, reuse_bytes // row_bytes)
    rows = layout.unique_pos.numel()
    lse = torch.empty(rows, dtype=acc, device=hidden.device)
    out_sorted = torch.empty(positions.numel(), dtype=acc, device=hidden.device)
    kept, offsets = {}, {}
    for c, (a, b) in enumerate(layout.chunks):
        hidden_rows = hidden[layout.unique_pos[a:b]]
        keep = b <= layout.kept_rows
        peak = torch.full((b - a,), float("-inf"), dtype=acc, device=hidden.device)
        total = torch.zeros(b - a, dtype=acc, device=hidden.device)
        block_peaks = []
        for j, (v0, v1) in enumerate(layout.blocks):
            logits = _chunk_logits(hidden_rows, weight[v0:v1], acc)
            lo, hi = layout.span(c, j)
            out_sorted[lo:hi] = logits[layout.row[lo:hi] - a, layout.token[lo:hi] - v0]
            block_peak = logits.amax(dim=-1)
            if keep:  # z - m of this block, in the kept dtype
                kept[c, j] = torch.sub(logits, block_peak[:, None], out=torch.empty(logits.shape, dtype=keep_as,
                                                                                    device=logits.device))
                block_peaks.append(block_peak)
            new_peak = torch.maximum(peak, block_peak)
            # the running sum of exp(z - peak), rescaled to the new peak; exp in place: no second block
            total.mul_(torch.exp(peak - new_peak)).add_(logits.sub_(new_peak[:, None]).exp_().sum(dim=-1))
            peak = new_peak
            del logits
        log_total = total.log_()
        lse[a:b] = peak + log_total
        if keep:  # m - logsumexp per row and block, as (m - peak) - log total: exact where m is the peak
            offsets[c] = torch.stack(block_peaks, dim=1).sub_(peak[:, None]).sub_(log_total[:, None])
    out_sorted.sub_(lse[layout.row])
    out = torch.empty_like(out_sorted)
    out[layout.order] = out_sorted
    ctx.save_for_backward(hidden, weight, lse)
    ctx.layout, ctx.kept, ctx.offsets = layout, kept, offsets
    return out


def _block_softmax(ctx, c, j, hidden_rows, weight_block, lse_rows, acc):
    """softmax of row chunk `c` over vocabulary block `j`, built in place: from the kept z - m when
    the forward kept it (then freed), else from recomputed logits."""
    kept = ctx.kept.pop((c, j), None)
    if kept is None:
        return _chunk_logits(hidden_rows, weight_block, acc).sub_(lse_rows[:, None]).exp_()
    kept = kept if kept.dtype == acc else kept.to(acc)
    return kept.add_(ctx.offsets[c][:, j, None]).exp_()


def _chunked_backward(ctx, grad_out):
    """Backward of `ChunkedTokenLogprobs`: gradients for hidden and weight, block by block."""
    import torch

    hidden, weight, lse = ctx.saved_tensors
    layout = ctx.layout
    acc = lse.dtype
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g_sorted = grad_out.to(acc)[layout.order]
    g_row = torch.zeros(layout.unique_pos.numel(), dtype=acc, device=hidden.device)
    g_row.index_add_(0, layout.row, g_sorted)
    grad_h_rows = torch.zeros(layout.unique_pos.numel(), hidden.shape[1], dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    for c, (a, b) in enumerate(layout.chunks):  # the kept chunks come first: their memory is freed first
        hidden_rows = hidden[layout.unique_pos[a:b]]
        for j, (v0, v1) in enumerate(layout.blocks):
            # d logits = scatter(g) - softmax * sum(g per position), built in place.
            d = _block_softmax(ctx, c, j, hidden_rows, weight[v0:v1], lse[a:b], acc).mul_(-g_row[a:b, None])
            lo, hi = layout.span(c, j)
            d.index_put_((layout.row[lo:hi] - a, layout.token[lo:hi] - v0), g_sorted[lo:hi], accumulate=True)
            d_mm = d if d.dtype == weight.dtype else d.to(weight.dtype)
            del d
            if need_h:
                if d_mm.dtype == acc:
                    grad_h_rows[a:b].addmm_(d_mm, weight[v0:v1])
                else:
                    grad_h_rows[a:b] += (d_mm @ weight[v0:v1]).to(acc)
            if need_w:
                if d_mm.dtype == acc:
                    grad_w[v0:v1].addmm_(d_mm.T, hidden_rows)  # in place: no [block, H] temporary
                else:
                    grad_w[v0:v1] += (d_mm.T @ hidden_rows).to(acc)
            del d_mm
    ctx.kept.clear()
    grad_hidden = None
    if need_h:
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        grad_hidden.index_add_(0, layout.unique_pos, grad_h_rows)
        grad_hidden = grad_hidden.to(hidden.dtype)
    if need_w:
        grad_w = grad_w.to(weight.dtype)
    return grad_hidden, grad_w, None, None, None, None, None, None


def _make_chunked_function():
    import torch

    class ChunkedTokenLogprobs(torch.autograd.Function):
        """log softmax(h W^T) gathered at (position, token) pairs, chunked over positions."""

        forward = staticmethod(_chunked_forward)
        backward = staticmethod(_chunked_backward)

    return ChunkedTokenLogprobs


_CHUNKED_FN = None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    tokens: torch.Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reuse_bytes: int = DEFAULT_REUSE_BYTES,
    reuse_dtype: str = DEFAULT_REUSE_DTYPE,
    vocab_block: int | None = None,
) -> torch.Tensor:
    """Student log-probabilities log softmax(hidden @ weight.T)[positions[g], tokens[g]].

    hidden: [P, H] last hidden states (flattened batch); weight: [V, H] LM head; positions,
    tokens: int64 [G]. Logits are formed a block at a time, `chunk_size` distinct positions
    (default 2,048, `auto_chunk_size`) by `vocab_block` ids (default about 2^24 logits per block of
    min(chunk_size, P) rows, `auto_vocab_block`), and formed again in backward, so memory is O(chunk_size x vocab_block)
    instead of O(P x V). reuse_bytes: the forward keeps the blocks of its first rows while they fit in
    this many bytes (V x the kept dtype's size per row), and the backward uses them instead of
    forming them again (a third of a block's time each); 0 keeps none, `keep_bytes_for(...)` sizes it
    from a memory budget. reuse_dtype: "float32" keeps them in the accumulation dtype (float64 for
    float64 inputs), exact; "float16" / "bfloat16" in 16 bits, twice the rows per byte, each
    probability within a factor exp(+-u |log p|) (u = 2^-11 / 2^-8). Only positions that are
    requested are computed. Returns [G] in float32 (float64 for float64 inputs); bf16/fp16 inputs
    give bf16 matmuls with float32 softmax and accumulation.
    Raises CsdError on mismatched shapes or out-of-range positions/tokens.
    """
    import torch

    global _CHUNKED_FN
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise CsdError(
            f"chunked_token_logprobs needs hidden [P, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}; flatten the batch and pass the LM head weight."
        )
    if chunk_size is None:
        chunk_size = auto_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise CsdError(f"chunk_size must be at least 1, got {chunk_size}; set loss.chunk_size.")
    if vocab_block is None:  # sized for the rows a chunk really has: a small batch gets wider blocks
        vocab_block = auto_vocab_block(weight.shape[0], min(chunk_size, hidden.shape[0]))
    if vocab_block < 1:
        raise CsdError(f"vocab_block must be at least 1, got {vocab_block}; leave it unset for the default.")
    if reuse_bytes < 0:
        raise CsdError(f"reuse_bytes must be 0 or more, got {reuse_bytes}; set the loss memory budget to 0 or more.")
    _keep_torch_dtype(reuse_dtype)
    positions = positions.to(device=hidden.device, dtype=torch.int64)
    tokens = tokens.to(device=hidden.device, dtype=torch.int64)
    if positions.numel() == 0:
        return torch.zeros(0, dtype=accumulation_dtype(hidden.dtype), device=hidden.device) + (
            hidden.sum() * 0 + weight.sum() * 0
        ).to(accumulation_dtype(hidden.dtype))
    _check_range(positions, hidden.shape[0], "position")
    _check_range(tokens, weight.shape[0], "token id")
    if _CHUNKED_FN is None:
        _CHUNKED_FN = _make_chunked_function()
    return _CHUNKED_FN.apply(hidden, weight, positions, tokens, int(chunk_size), int(vocab_block), int(reuse_bytes),
                             reuse_dtype)


def auto_chunk_size(vocab_size: int) -> int:
    """The default positions per row chunk: 2,048, or about 2^24 / V when that is more (a small vocabulary)."""
    return max(_AUTO_ROWS, _AUTO_BLOCK_ELEMENTS // max(1, vocab_size))


def auto_vocab_block(vocab_size: int, chunk_size: int) -> int:
    """The default ids per vocabulary block: about 2^24 logits per block (64 MiB in float32), at most V."""
    return max(1, min(vocab_size, _AUTO_BLOCK_ELEMENTS // max(1, chunk_size)))


def keep_bytes_for(budget_bytes: int, vocab_size: int, chunk_size: int | None = None, element_size: int = 4) -> int:
    """`reuse_bytes` from a memory budget for the loss's logits: the budget less the one block the loss
    always holds (0 when the budget is smaller than a block)."""
    rows = chunk_size or auto_chunk_size(vocab_size)
    block = rows * auto_vocab_block(vocab_size, rows) * element_size
    return max(0, int(budget_bytes) - block)


def dense_token_logprobs(logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[positions, tokens] from already materialised logits [P, V].

    For tests and small models; computes the softmax only at the requested positions.
    Returns float32 (float64 for float64 logits). Raises CsdError on bad indices.
    """
    import torch

    acc = accumulation_dtype(logits.dtype)
    positions = positions.to(device=logits.device, dtype=torch.int64)
    tokens = tokens.to(device=logits.device, dtype=torch.int64)
    if positions.numel() == 0:
        return torch.zeros(0, dtype=acc, device=logits.device) + (logits.sum() * 0).to(acc)
    _check_range(positions, logits.shape[0], "position")
    _check_range(tokens, logits.shape[1], "token id")
    unique_pos, inverse = torch.unique(positions, return_inverse=True)
    rows = logits[unique_pos].to(acc)
    return rows[inverse, tokens] - torch.logsumexp(rows, dim=-1)[inverse]


def _check_range(values, upper: int, what: str) -> None:
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= upper:
        raise CsdError(
            f"a requested {what} ({lo if lo < 0 else hi}) is outside [0, {upper}); the events do not "
            f"match the student batch or vocabulary: rebuild them with the student's tokenizer."
        )


def student_inputs(ce_positions, ce_tokens, teachers, *, hidden, weight, logits, loss: str):
    """What every loss does first with its inputs: check that it got the student's `hidden` and `weight`
    (chunked path) or its `logits`, and move the CE targets and each teacher's rows to the student's device.

    Returns (device, ce_positions, ce_tokens, teachers). Raises CsdError naming `loss` on a wrong combination.
    """
    import torch

    if (logits is None) == (hidden is None or weight is None):
        raise CsdError(f"{loss} needs either hidden and weight (chunked path) or logits, not both.")
    device = logits.device if logits is not None else hidden.device
    return (device, torch.as_tensor(ce_positions, dtype=torch.int64).to(device),
            torch.as_tensor(ce_tokens, dtype=torch.int64).to(device), [t.to(device) for t in teachers])


def gather_parts(pos_parts, tok_parts, *, hidden=None, weight=None, logits=None, **chunked):
    """The student's log-probabilities of each part's (position, token) pairs, gathered in one pass over the
    vocabulary (`dense_token_logprobs` from `logits`, else `chunked_token_logprobs` with `chunked`'s options)
    and split back into one tensor per part."""
    import torch

    positions, tokens = torch.cat(pos_parts), torch.cat(tok_parts)
    if logits is not None:
        gathered = dense_token_logprobs(logits, positions, tokens)
    else:
        gathered = chunked_token_logprobs(hidden, weight, positions, tokens, **chunked)
    return torch.split(gathered, [p.numel() for p in pos_parts])
