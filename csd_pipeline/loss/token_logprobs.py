"""Student log-probabilities at requested (position, token) pairs, without a [positions x vocab] tensor.

`chunked_token_logprobs(hidden, weight, positions, tokens)` computes log softmax(h W^T)[p, t] for the
requested pairs: logits are formed one position chunk at a time in forward and recomputed in
backward (as fused LM-head losses do). Only h, W and one logsumexp per position are saved, plus,
within `keep_bytes`, what the backward needs of the first chunks' softmax: the backward reuses it
instead of recomputing the chunk (one matrix product of the four per chunk), so memory buys speed.
`keep_dtype` says how a kept chunk is stored: "float32" (the default) keeps the exponentiated
logits exp(z - row max) and their row sums in the accumulation dtype, exactly; "float16" or
"bfloat16" keeps the chunk's log-probabilities z - logsumexp(z) in that dtype, half the bytes, so
twice the chunks fit in the same budget. Rounding log p to a 16-bit float with unit roundoff u
(2^-11 for float16, 2^-8 for bfloat16) changes each probability by a factor exp(+-u |log p|), so
the softmax row's L1 error is at most about u x its entropy in nats: small where the gradient
1[t] - p cancels (p near 1, log p near 0) and relative error bounded for tiny probabilities
(no underflow above log p = -65,504). The backward turns a kept 16-bit chunk back into the
accumulation dtype in row blocks no larger than the kept chunk, so it holds no extra chunk.
`dense_token_logprobs(logits, positions, tokens)` does the same from materialised logits (tests,
small models). The CSD loss (`loss.csd`) and held-out bits per byte gather from these.

torch is imported inside functions so that importing this module is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from csd_pipeline.errors import CsdError

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_CHUNK_SIZE = None  # auto: about 2^25 logits (128 MiB in float32) per position chunk
DEFAULT_KEEP_BYTES = 0  # logits kept from forward for backward: none (the least memory)
KEEP_DTYPES = ("float32", "bfloat16", "float16")  # how kept chunks are stored (see the module docstring)
DEFAULT_KEEP_DTYPE = "float32"
KEEP_UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # u of the 16-bit kept log-probabilities
_AUTO_CHUNK_ELEMENTS = 1 << 25
_EXP_BLOCK_ROWS = 16  # rows per block of the forward's exp-and-sum when it keeps 16-bit log-probabilities


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _request_layout(positions: torch.Tensor, tokens: torch.Tensor, chunk_size: int):
    """Sort requests by position; return the unique positions, per-chunk request ranges and the
    request end of each unique position (host list, for splitting a chunk into row blocks)."""
    import torch

    order = torch.argsort(positions, stable=True)
    pos_sorted = positions[order]
    tok_sorted = tokens[order]
    unique_pos, counts = torch.unique_consecutive(pos_sorted, return_counts=True)
    row_of_request = torch.repeat_interleave(torch.arange(unique_pos.numel(), device=positions.device), counts)
    # Request range of each position chunk: one host sync per call, not one per chunk.
    ends = torch.cumsum(counts, 0).cpu().tolist()
    return order, unique_pos, row_of_request, tok_sorted, _row_blocks(ends, 0, unique_pos.numel(), chunk_size), ends


def _row_blocks(ends: list, start: int, stop: int, rows: int) -> list:
    """(a, b, lo, hi) for each block of `rows` unique positions in [start, stop): rows a..b-1 and
    their requests lo..hi-1 (`ends`: the request end of each unique position)."""
    bounds = []
    for a in range(start, stop, rows):
        b = min(a + rows, stop)
        bounds.append((a, b, ends[a - 1] if a > 0 else 0, ends[b - 1]))
    return bounds


def _chunk_logits(hidden_rows, weight, acc_dtype):
    logits = hidden_rows @ weight.T
    return logits if logits.dtype == acc_dtype else logits.to(acc_dtype)


def _keep_torch_dtype(keep_dtype: str):
    """The torch dtype of kept 16-bit log-probabilities; None for "float32" (exponentiated logits)."""
    import torch

    if keep_dtype not in KEEP_DTYPES:
        raise CsdError(f"keep_dtype must be one of {', '.join(KEEP_DTYPES)}, got {keep_dtype!r}; "
                       "set --loss-keep-dtype to one of them.")
    return None if keep_dtype == "float32" else getattr(torch, keep_dtype)


def _exp_row_sums(z):
    """sum(exp(z), dim=-1) of a [rows, V] tensor, a block of rows at a time (no second [rows, V] tensor)."""
    import torch

    n = min(_EXP_BLOCK_ROWS, z.shape[0])
    buffer = torch.empty((n, z.shape[1]), dtype=z.dtype, device=z.device)
    total = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    for r in range(0, z.shape[0], n):
        rows = min(n, z.shape[0] - r)
        total[r : r + rows] = torch.exp(z[r : r + rows], out=buffer[:rows]).sum(dim=-1)
    return total


def _chunked_forward(ctx, hidden, weight, positions, tokens, chunk_size, keep_bytes, keep_dtype):
    """Forward of `ChunkedTokenLogprobs`: the gathered log-probabilities, one position chunk at a time."""
    import torch

    acc = _accumulation_dtype(hidden.dtype)
    keep16 = _keep_torch_dtype(keep_dtype)
    order, unique_pos, row_of_request, tok_sorted, bounds, ends = _request_layout(positions, tokens, chunk_size)
    lse = torch.empty(unique_pos.numel(), dtype=acc, device=hidden.device)
    out_sorted = torch.empty(positions.numel(), dtype=acc, device=hidden.device)
    kept, budget = {}, keep_bytes
    for index, (a, b, lo, hi) in enumerate(bounds):
        logits = _chunk_logits(hidden[unique_pos[a:b]], weight, acc)
        rows = row_of_request[lo:hi] - a
        picked = logits[rows, tok_sorted[lo:hi]]
        size = logits.numel() * (logits.element_size() if keep16 is None else keep16.itemsize)
        keep = size <= budget  # the first chunks that fit: the backward starts with them and frees them
        # logsumexp in place (no second [chunk, V] tensor): e = exp(logits - row max), lse = max + log sum e
        peak = logits.amax(dim=-1)
        if keep and keep16 is not None:  # z = logits - max; keep z - log sum exp(z) in 16 bits
            log_total = _exp_row_sums(logits.sub_(peak[:, None])).log_()
            lse_c = peak + log_total
            kept[index] = torch.sub(logits, log_total[:, None], out=torch.empty(logits.shape, dtype=keep16,
                                                                              device=logits.device))
        else:
            total = logits.sub_(peak[:, None]).exp_().sum(dim=-1)
            lse_c = peak + total.log()
            if keep:
                kept[index] = (logits, total)
        lse[a:b] = lse_c
        out_sorted[lo:hi] = picked - lse_c[rows]
        budget -= size if keep else 0
        del logits
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    ctx.save_for_backward(hidden, weight, order, unique_pos, row_of_request, tok_sorted, lse)
    ctx.bounds, ctx.ends = bounds, ends
    ctx.kept = kept
    return out


def _chunk_softmax_grads(ctx, index, a, b, lo, hi, hidden, weight, unique_pos, lse, g_row, acc):
    """Yield (d, (a, b, lo, hi)) for chunk `index`: d = -softmax * g_row of rows a..b-1, built in place,
    from the kept chunk when the forward kept it, else from recomputed logits. A 16-bit kept chunk
    comes back in row blocks no larger than itself. No local names a yielded d (the caller frees it)."""
    kept = ctx.kept.pop(index, None)
    if kept is None:
        yield _chunk_logits(hidden[unique_pos[a:b]], weight, acc).sub_(lse[a:b, None]).exp_().mul_(
            -g_row[a:b, None]), (a, b, lo, hi)
    elif isinstance(kept, tuple):  # exp(logits - row max) and its row sums, from the forward: softmax = e / sum
        scale = (-g_row[a:b] / kept[1])[:, None]
        yield kept[0].mul_(scale), (a, b, lo, hi)
    else:  # 16-bit log-probabilities
        block = max(1, (b - a) * kept.element_size() // lse.element_size())
        for a2, b2, lo2, hi2 in _row_blocks(ctx.ends, a, b, block):
            yield kept[a2 - a : b2 - a].to(acc).exp_().mul_(-g_row[a2:b2, None]), (a2, b2, lo2, hi2)


def _chunked_backward(ctx, grad_out):
    """Backward of `ChunkedTokenLogprobs`: gradients for hidden and weight, chunk by chunk."""
    import torch

    hidden, weight, order, unique_pos, row_of_request, tok_sorted, lse = ctx.saved_tensors
    acc = lse.dtype
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    g_sorted = grad_out.to(acc)[order]
    g_row = torch.zeros(unique_pos.numel(), dtype=acc, device=hidden.device)
    g_row.index_add_(0, row_of_request, g_sorted)
    grad_h_rows = (
        torch.empty(unique_pos.numel(), hidden.shape[1], dtype=acc, device=hidden.device) if need_h else None
    )
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    for index, chunk in enumerate(ctx.bounds):
        # d logits = scatter(g) - softmax * sum(g per position), built in place.
        for d, (a, b, lo, hi) in _chunk_softmax_grads(ctx, index, *chunk, hidden, weight, unique_pos, lse, g_row, acc):
            rows = row_of_request[lo:hi] - a
            d.index_put_((rows, tok_sorted[lo:hi]), g_sorted[lo:hi], accumulate=True)
            d_mm = d if d.dtype == weight.dtype else d.to(weight.dtype)
            del d
            if need_h:
                grad_h_rows[a:b] = (d_mm @ weight).to(acc)
            if need_w:
                h_c = hidden[unique_pos[a:b]]
                if d_mm.dtype == acc:
                    grad_w.addmm_(d_mm.T, h_c)  # in place: no [V, H] temporary per chunk
                else:
                    grad_w += (d_mm.T @ h_c).to(acc)
            del d_mm
    grad_hidden = None
    if need_h:
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        grad_hidden.index_add_(0, unique_pos, grad_h_rows)
        grad_hidden = grad_hidden.to(hidden.dtype)
    if need_w:
        grad_w = grad_w.to(weight.dtype)
    return grad_hidden, grad_w, None, None, None, None, None


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
    keep_bytes: int = DEFAULT_KEEP_BYTES,
    keep_dtype: str = DEFAULT_KEEP_DTYPE,
) -> torch.Tensor:
    """Student log-probabilities log softmax(hidden @ weight.T)[positions[g], tokens[g]].

    hidden: [P, H] last hidden states (flattened batch); weight: [V, H] LM head; positions,
    tokens: int64 [G]. Logits are formed `chunk_size` distinct positions at a time (default: about
    2^25 logits per chunk, 256 positions at V = 128k) and recomputed in backward, so memory is
    O(chunk_size x V) instead of O(P x V). keep_bytes: the forward keeps the softmax of its first
    chunks while they fit in this many bytes, and the backward uses them instead of recomputing
    (about a quarter of the chunk's time each); 0 keeps none, `keep_bytes_for(...)` sizes it from a
    memory budget. keep_dtype: "float32" keeps exponentiated logits (float32; float64 for float64
    inputs), exact; "float16" / "bfloat16" keeps log-probabilities in 16 bits, twice the chunks
    per byte, each probability within a factor exp(+-u |log p|) (u = 2^-11 / 2^-8). Only positions
    that are requested are computed. Returns [G] in float32 (float64 for float64 inputs);
    bf16/fp16 inputs give bf16 matmuls with float32 softmax and accumulation.
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
    if keep_bytes < 0:
        raise CsdError(f"keep_bytes must be 0 or more, got {keep_bytes}; set the loss memory budget to 0 or more.")
    _keep_torch_dtype(keep_dtype)
    positions = positions.to(device=hidden.device, dtype=torch.int64)
    tokens = tokens.to(device=hidden.device, dtype=torch.int64)
    if positions.numel() == 0:
        return torch.zeros(0, dtype=_accumulation_dtype(hidden.dtype), device=hidden.device) + (
            hidden.sum() * 0 + weight.sum() * 0
        ).to(_accumulation_dtype(hidden.dtype))
    _check_range(positions, hidden.shape[0], "position")
    _check_range(tokens, weight.shape[0], "token id")
    if _CHUNKED_FN is None:
        _CHUNKED_FN = _make_chunked_function()
    return _CHUNKED_FN.apply(hidden, weight, positions, tokens, int(chunk_size), int(keep_bytes),
                               keep_dtype)


def auto_chunk_size(vocab_size: int) -> int:
    """The default positions per chunk: about 2^25 logits (128 MiB in float32), at least 8."""
    return max(8, _AUTO_CHUNK_ELEMENTS // max(1, vocab_size))


def keep_bytes_for(budget_bytes: int, vocab_size: int, chunk_size: int | None = None, element_size: int = 4) -> int:
    """`keep_bytes` from a memory budget for the loss's logits: the budget less the one chunk the loss
    always holds (0 when the budget is smaller than a chunk)."""
    chunk = (chunk_size or auto_chunk_size(vocab_size)) * vocab_size * element_size
    return max(0, int(budget_bytes) - chunk)


def dense_token_logprobs(logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[positions, tokens] from already materialised logits [P, V].

    For tests and small models; computes the softmax only at the requested positions.
    Returns float32 (float64 for float64 logits). Raises CsdError on bad indices.
    """
    import torch

    acc = _accumulation_dtype(logits.dtype)
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
