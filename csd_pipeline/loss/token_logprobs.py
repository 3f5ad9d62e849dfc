"""Student log-probabilities at requested (position, token) pairs, without a [positions x vocab] tensor.

`chunked_token_logprobs(hidden, weight, positions, tokens)` computes log softmax(h W^T)[p, t] for the
requested pairs: logits are formed one position chunk at a time in forward and recomputed in
backward (as fused LM-head losses do). Only h, W and one logsumexp per position are saved, plus,
within `keep_bytes`, the exponentiated logits of the first chunks: the backward reuses those
instead of recomputing them (one matrix product of the four per chunk and two elementwise passes),
so memory buys speed.
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
_AUTO_CHUNK_ELEMENTS = 1 << 25


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32


def _request_layout(positions: torch.Tensor, tokens: torch.Tensor, chunk_size: int):
    """Sort requests by position; return the unique positions and per-chunk request ranges."""
    import torch

    order = torch.argsort(positions, stable=True)
    pos_sorted = positions[order]
    tok_sorted = tokens[order]
    unique_pos, counts = torch.unique_consecutive(pos_sorted, return_counts=True)
    row_of_request = torch.repeat_interleave(torch.arange(unique_pos.numel(), device=positions.device), counts)
    # Request range of each position chunk: one host sync per call, not one per chunk.
    ends = torch.cumsum(counts, 0).cpu().tolist()
    bounds = []
    n_unique = unique_pos.numel()
    for a in range(0, n_unique, chunk_size):
        b = min(a + chunk_size, n_unique)
        lo = ends[a - 1] if a > 0 else 0
        bounds.append((a, b, lo, ends[b - 1]))
    return order, unique_pos, row_of_request, tok_sorted, bounds


def _chunk_logits(hidden_rows, weight, acc_dtype):
    logits = hidden_rows @ weight.T
    return logits if logits.dtype == acc_dtype else logits.to(acc_dtype)


def _chunked_forward(ctx, hidden, weight, positions, tokens, chunk_size, keep_bytes):
    """Forward of `ChunkedTokenLogprobs`: the gathered log-probabilities, one position chunk at a time."""
    import torch

    acc = _accumulation_dtype(hidden.dtype)
    order, unique_pos, row_of_request, tok_sorted, bounds = _request_layout(positions, tokens, chunk_size)
    lse = torch.empty(unique_pos.numel(), dtype=acc, device=hidden.device)
    out_sorted = torch.empty(positions.numel(), dtype=acc, device=hidden.device)
    kept, budget = {}, keep_bytes
    for index, (a, b, lo, hi) in enumerate(bounds):
        logits = _chunk_logits(hidden[unique_pos[a:b]], weight, acc)
        rows = row_of_request[lo:hi] - a
        picked = logits[rows, tok_sorted[lo:hi]]
        # logsumexp in place (no second [chunk, V] tensor): e = exp(logits - row max), lse = max + log sum e
        peak = logits.amax(dim=-1)
        total = logits.sub_(peak[:, None]).exp_().sum(dim=-1)
        lse_c = peak + total.log()
        lse[a:b] = lse_c
        out_sorted[lo:hi] = picked - lse_c[rows]
        size = logits.numel() * logits.element_size()
        if size <= budget:  # the first chunks that fit: the backward starts with them and frees them
            kept[index], budget = (logits, total), budget - size
        del logits
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    ctx.save_for_backward(hidden, weight, order, unique_pos, row_of_request, tok_sorted, lse)
    ctx.bounds = bounds
    ctx.kept = kept
    return out


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
    for index, (a, b, lo, hi) in enumerate(ctx.bounds):
        h_c = hidden[unique_pos[a:b]]
        # d logits = scatter(g) - softmax * sum(g per position), built in place (in the kept
        # logits of this chunk when the forward kept them, else in recomputed ones).
        kept = ctx.kept.pop(index, None)
        if kept is None:
            d = _chunk_logits(h_c, weight, acc)
            d.sub_(lse[a:b, None]).exp_().mul_(-g_row[a:b, None])
        else:  # exp(logits - row max) and its row sums, from the forward: softmax = e / sum
            d, total = kept
            d.mul_((-g_row[a:b] / total)[:, None])
        rows = row_of_request[lo:hi] - a
        d.index_put_((rows, tok_sorted[lo:hi]), g_sorted[lo:hi], accumulate=True)
        d_mm = d if d.dtype == weight.dtype else d.to(weight.dtype)
        del d
        if need_h:
            grad_h_rows[a:b] = (d_mm @ weight).to(acc)
        if need_w:
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
    return grad_hidden, grad_w, None, None, None, None


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
) -> torch.Tensor:
    """Student log-probabilities log softmax(hidden @ weight.T)[positions[g], tokens[g]].

    hidden: [P, H] last hidden states (flattened batch); weight: [V, H] LM head; positions,
    tokens: int64 [G]. Logits are formed `chunk_size` distinct positions at a time (default: about
    2^25 logits per chunk, 256 positions at V = 128k) and recomputed in backward, so memory is
    O(chunk_size x V) instead of O(P x V). keep_bytes: the forward keeps the logits (float32;
    float64 for float64 inputs) of its first chunks while they fit in this many bytes, and the
    backward uses them instead of recomputing (about a quarter of the chunk's time each); 0 keeps
    none, `keep_bytes_for(...)` sizes it from a memory budget. Only positions
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
    return _CHUNKED_FN.apply(hidden, weight, positions, tokens, int(chunk_size), int(keep_bytes))


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
