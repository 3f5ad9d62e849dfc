"""What the stored top-k costs `--loss alm`'s whitespace debiasing, measured with the real teacher (not a test).

tokenkit debiases each chunk with the teacher's whole next-token row (its mass on whitespace-starting and
special tokens after the chunk); `events.alm_rows` has only the store: the stored entries at the chunk's last
teacher position plus the observed next token, a lower bound. This script aligns a few real held-out windows,
writes a top-k store with the real teacher (`teacher-logits`), runs the same teacher once more for its whole
rows, and prints, per language and stored k (the first k of the store's entries):

- how often a chunk end's stored entries hold no whitespace token at all (the teacher side gets the floor);
- the gap log(full mass) - log(stored mass) over the other chunk ends (median, mean, 90th percentile);
- with a student (`--student`, a fixture model with the aligned student tokenizer): the ALM term with the stored
  and with the full mass (tau 100), and the cosine between their gradients on the student's logits.

    python -m tests.loss.alm_debias_measure --work DIR [--teacher gemma3-270m --teacher-tokenizer gemma3
        --student smollm2-135m-instruct --student-tokenizer smollm2] [--docs 6]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"de": "bench/corpus/multilingual/heldout-de.jsonl", "ja": "bench/corpus/multilingual/heldout-ja.jsonl",
           "en": "bench/corpus/multilingual/heldout-en.jsonl", "devil": "demo/corpus/devil-heldout.jsonl"}


def _corpus(work: Path, language: str, docs: int) -> Path:
    lines = (ROOT / SOURCES[language]).read_text(encoding="utf-8").splitlines()[:docs]
    path = work / f"{language}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _prepare(work: Path, language: str, args) -> tuple[Path, Path]:
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.csd_cases import bundle, cached_table_file

    aligned, store = work / f"aligned-{language}", work / f"topk-{language}"
    if not (store / "manifest.json").is_file():
        s, t = bundle(tokenizer_path, args.student_tokenizer), bundle(tokenizer_path, args.teacher_tokenizer)
        run_align(AlignConfig(corpus=[str(_corpus(work, language, args.docs))], student_tokenizer=args.student_tokenizer,
                              teacher_tokenizers=[args.teacher_tokenizer], output=str(aligned),
                              max_student_tokens=args.window,
                              tables=[(cached_table_file(s, t), cached_table_file(t, s))]))
        run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=args.teacher, output=str(store),
                                               top_k=max(args.k), device="cpu"))
    return aligned, store


def _rows(aligned: Path, store: Path, limit: int):
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.teacher.store.reader import read_teacher_topk

    output = AlignedOutput.open(aligned)
    columns = output.training_columns([0])
    aligned_rows = []
    for shard in output.shards:
        table = output.read(shard, columns).to_pydict()
        aligned_rows += [{key: np.asarray(table[key][i]) if key != "row_id" else table[key][i] for key in columns}
                         for i in range(len(table["row_id"]))]
    return list(zip(aligned_rows, read_teacher_topk(store), strict=True))[:limit], output


def _full_space(model, teacher_ids, mask):
    """log of the teacher's whole-row mass on `mask` at every position, and its log-probs of the next tokens."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(teacher_ids[None, :]), use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits[:, :len(mask)], -1)
    space = torch.logsumexp(logp[:, torch.as_tensor(mask)], -1).numpy()
    observed = logp[torch.arange(len(teacher_ids) - 1), torch.as_tensor(teacher_ids[1:])].numpy()
    return space, observed


def _cut(top, k: int):
    """The first k stored entries of a teacher row (the store's order: most likely first)."""
    keep = np.arange(top.ids.shape[1])[None, :] < np.minimum(np.asarray(top.lengths), k)[:, None]
    return replace(top, ids=np.where(keep, top.ids, -1), logprobs=np.where(keep, top.logprobs, -np.inf),
                   lengths=np.minimum(np.asarray(top.lengths), k))


def measure(language: str, args) -> dict:
    from csd_pipeline.events.alm_rows import TEACHER_SPACE_FLOOR, build_alm_rows, space_mask
    from csd_pipeline.events.context import EventContext
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from tests.csd_cases import bundle, cached_table

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    aligned, store = _prepare(work, language, args)
    pairs, _ = _rows(aligned, store, args.windows)
    s, t = bundle(tokenizer_path, args.student_tokenizer), bundle(tokenizer_path, args.teacher_tokenizer)
    ctx = EventContext(cached_table(s, t), cached_table(t, s), s.vocab, t.vocab)
    teacher = load_causal_lm(args.teacher, device="cpu", dtype="float32").model.eval()
    mask = space_mask(t.vocab)
    out = {"language": language, "windows": len(pairs), "k": {}}
    full_rows, store_rows = [], {k: [] for k in args.k}
    observed_gap = []
    for aligned_row, top in pairs:
        t_ids = np.asarray(aligned_row["teacher0_ids"], dtype=np.int64)
        full, observed = _full_space(teacher, t_ids, mask)
        observed_gap.append(np.nanmax(np.abs(observed - np.asarray(top.observed_logprob)[:-1])))
        rows = {k: build_alm_rows(aligned_row, 0, _cut(top, k), ctx) for k in args.k}
        ends = _chunk_ends(aligned_row, ctx)
        full_rows.append((aligned_row, top, full[ends]))
        for k in args.k:
            store_rows[k].append(rows[k])
    full_space = np.concatenate([f for _, _, f in full_rows])
    out["chunks"] = int(full_space.size)
    out["full_mass_median"] = float(np.median(np.exp(full_space)))
    out["store_vs_full_observed_max_abs"] = float(max(observed_gap))
    for k in args.k:
        stored = np.concatenate([r.teacher_space_logp for r in store_rows[k]])
        finite = stored > math.log(TEACHER_SPACE_FLOOR)  # the others store no whitespace token: the floor
        gap = full_space[finite] - stored[finite]
        out["k"][k] = {"no_whitespace_stored": float(1 - finite.mean()), "gap_median": float(np.median(gap)),
                       "gap_mean": float(gap.mean()), "gap_p90": float(np.quantile(gap, 0.9)),
                       "gap_over_0.1_nats": float((gap > 0.1).mean())}
    if args.student:
        out["student"] = _student_effect(args, pairs, store_rows, full_rows, ctx)
    return out


def _chunk_ends(aligned_row, ctx):
    """The last teacher position of every chunk that `build_alm_rows` keeps, in its order."""
    from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks

    row = read_aligned_chunks(aligned_row, 0, ctx)
    keep = (row.status == ACCEPTED) & (row.student_start > 0) & (row.teacher_start > 0)
    return (row.teacher_start + row.teacher_len - 1)[keep]


def _student_effect(args, pairs, store_rows, full_rows, ctx) -> dict:
    """ALM (tau 100) with the stored and the full whitespace mass, per k: relative value gap, gradient cosine."""
    import torch

    from csd_pipeline.events.alm_rows import collate_alm_rows
    from csd_pipeline.events.batch import ce_targets
    from csd_pipeline.loss.alm import alm_loss
    from csd_pipeline.runtime.model_loading import load_causal_lm

    student = load_causal_lm(args.student, device="cpu", dtype="float32").model.eval()
    windows = [np.asarray(a["student_ids"], dtype=np.int64) for a, _ in pairs]
    offsets = np.cumsum([0] + [len(w) for w in windows])[:-1]
    with torch.no_grad():
        logits = torch.cat([student(input_ids=torch.as_tensor(w[None, :]), use_cache=False).logits[0] for w in windows])
    cp, ct = ce_targets(windows, [np.asarray(a["student_loss_mask"]) for a, _ in pairs], offsets)

    def run(rows):
        x = logits.clone().requires_grad_(True)
        out = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[rows], logits=x, kd_scale=0.0)
        out.kd.backward()
        return float(out.kd.detach()), x.grad.flatten()

    def ce_gradient():
        x = logits.clone().requires_grad_(True)
        alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[], logits=x, kd_scale=0.0).ce.backward()
        return x.grad.flatten()

    result = {}
    full_batch = None
    for k in args.k:
        batch = collate_alm_rows(store_rows[k], offsets)
        if full_batch is None:
            full_batch = replace(batch, teacher_space_logp=np.concatenate([f for _, _, f in full_rows]))
            kd_full, g_full = run(full_batch)
            g_ce = ce_gradient()
            result["kd_full"] = kd_full
            result["grad_norm_alm_over_ce"] = float(g_full.norm() / g_ce.norm())
        kd_k, g_k = run(batch)
        result[f"k{k}"] = {"kd_relative_gap": (kd_k - kd_full) / kd_full,
                           "grad_cosine": float(torch.nn.functional.cosine_similarity(g_k, g_full, dim=0)),
                           "grad_norm_ratio": float(g_k.norm() / g_full.norm())}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True)
    parser.add_argument("--languages", default="de,ja,en")
    parser.add_argument("--teacher", default="gemma3-270m")
    parser.add_argument("--teacher-tokenizer", default="gemma3")
    parser.add_argument("--student", default="smollm2-135m-instruct")
    parser.add_argument("--student-tokenizer", default="smollm2")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[8, 32, 128])
    args = parser.parse_args(argv)
    for language in args.languages.split(","):
        print(json.dumps(measure(language, args), default=lambda v: None if isinstance(v, float) and math.isnan(v)
                         else v), flush=True)


if __name__ == "__main__":
    main()
