"""`process_results` of the held-out text tasks: each passage's own bits per byte beside the byte-weighted one.

lm-evaluation-harness imports this module by path from the task YAML (`!function scoring.passage_scores`) and
calls it once per document with the document's rolling log-likelihood (natural log, summed over its tokens).
`bits_per_byte` is the (log-likelihood, bytes) pair the harness's own `loglikelihood_rolling` scoring yields,
aggregated as it aggregates it (all passages' bytes together; no standard error). `passage_bits_per_byte` is
one number per passage, averaged with `aggregation: mean`, so the harness attaches its closed-form standard
error (sample standard deviation over the square root of the number of passages).
"""

from __future__ import annotations

import math


def passage_scores(doc: dict, results: list) -> dict:
    """The metrics of one passage: its bits per byte, and the (log-likelihood, bytes) pair pooled over passages."""
    from lm_eval.api.task import Task  # the harness's own byte count

    (loglikelihood,) = results
    n_bytes = Task.count_bytes(doc["text"])
    return {"passage_bits_per_byte": -loglikelihood / n_bytes / math.log(2), "bits_per_byte": (loglikelihood, n_bytes)}
