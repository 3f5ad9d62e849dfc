"""The two settings of bench_onpolicy.py: the demo's (a from-scratch student) and issue 33's multilingual one.

A setting says who teaches, which prompts the students continue (training and held out), the recipe both arms
train with, the base student the arms start from, and how held-out bits per byte are measured:

- `demo`: teacher SmolLM2-135M-Instruct; prompts are the first 200 characters (cut at whitespace) of the demo's
  training / held-out documents; the base is a demo-recipe CSD student; held-out bits per byte on
  demo/corpus/devil-heldout.jsonl.
- `multilingual`: teacher Gemma 3 270M; the base is bench/experiments/pretrained.py's CSD student (SmolLM2-135M-Instruct
  trained in the `repeated` regime with `csd kl b1 t1.5 fixed0.5`, seed 0), and both arms train with that recipe
  (learning rate 5e-5, 5 warm-up steps, T 1.5, fixed KD weight 0.5) but with the run's `--divergence`.
  Prompts: a place in a document, cut to about 64 SmolLM2 tokens (PROMPT_CHARS: 160 characters at the last
  whitespace in German, French, Spanish; 55 characters in Japanese and Chinese, which SmolLM2 spells with about
  1.2 tokens per character), one file per language. Training prompts come from the non-English training
  documents (`--prompts / 5` of each language: every document cut at evenly spaced word starts, as many per
  document as that needs, e.g. 2 for 500 prompts); held-out prompts from the held-out documents, two per
  document (its start, and the start of its second half). Held-out bits per byte per language (five languages
  and English, on bench/experiments/pretrained.py's aligned held-out folders); `heldout_bits_per_byte` is the non-English mean.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 256
DEMO_PROMPT_CHARS = 200
MULTILINGUAL = ROOT / "bench/corpus/multilingual"
PROMPT_CHARS = {"de": 160, "fr": 160, "es": 160, "ja": 55, "zh-cn": 55}
CJK = {"ja", "zh-cn"}
REFERENCE_CHARS = 1200  # the reference continuation kept for off-policy training (cut further there)
BASE_ARM, BASE_REGIME, BASE_SEED = "csd kl b1 t1.5 fixed0.5", "repeated", 0
KD_WEIGHTING = ("--kd-scale", "fixed", "--kd-weight", "0.5")  # with CE; rounds without --ce train KD alone
PRETRAINED_RECIPE = ("--lr", "5e-5", "--warmup-steps", "5", "--beta", "1", "--teacher-temperature", "1.5",
                     *KD_WEIGHTING)


@dataclass(frozen=True)
class Setting:
    name: str
    teacher: str
    teacher_tokenizer: str
    prompt_field: str  # of the prompt files
    prompt_chars: int  # generate --prompt-chars (0: the prompt files hold whole prompts)
    recipe: tuple = ()  # csd-train flags of both arms beyond the shared ones

    def round_recipe(self, ce: bool) -> tuple:
        """The recipe of the on-policy rounds: without CE (GKD's way) its KD weighting goes (the rounds fix it)."""
        if ce or KD_WEIGHTING[0] not in self.recipe:
            return self.recipe
        at = self.recipe.index(KD_WEIGHTING[0])
        return self.recipe[:at] + self.recipe[at + len(KD_WEIGHTING):]


DEMO = Setting("demo", "smollm2-135m-instruct", "smollm2", "text", DEMO_PROMPT_CHARS)
MULTI = Setting("multilingual", "gemma3-270m", "gemma3", "prompt", 0, PRETRAINED_RECIPE)
SETTINGS = {s.name: s for s in (DEMO, MULTI)}

_CJK_CHAR = r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]"
_UNITS = re.compile(rf"{_CJK_CHAR}|(?:(?!{_CJK_CHAR})\S)+")


def units(text: str) -> list[str]:
    """Words for 2-gram counting: runs of non-space characters, each CJK character a word of its own (Japanese
    and Chinese put no spaces between words); for English text this is `text.split()`."""
    return _UNITS.findall(text)


def _cut(text: str, lang: str) -> int:
    """Where a prompt of `lang` ends: PROMPT_CHARS characters, at the last whitespace for space-separated
    languages (0: no whitespace to cut at)."""
    chars = PROMPT_CHARS[lang]
    if lang in CJK or len(text) <= chars:
        return min(chars, len(text))
    cut = text.rfind(" ", 0, chars + 1)
    newline = text.rfind("\n", 0, chars + 1)
    return max(cut, newline, 0)


def _entries(text: str, lang: str, starts: list[int]) -> list[dict]:
    entries = []
    for start in starts:
        rest = text[start:]
        cut = _cut(rest, lang)
        if 0 < cut < len(rest) and rest[:cut].strip():
            entries.append({"prompt": rest[:cut], "reference": rest[cut:cut + REFERENCE_CHARS]})
    return entries


def _word_start(text: str, at: int, lang: str) -> int:
    """The first character of a word at or after `at` (in Japanese and Chinese: the first after any punctuation
    and whitespace there)."""
    if at == 0:
        return at
    if lang in CJK:
        return next((i for i in range(at, len(text)) if text[i].isalnum()), at)
    return next((i + 1 for i in range(at - 1, len(text) - 1) if text[i] in " \n" and text[i + 1] not in " \n"), at)


def train_entries(documents: list[str], lang: str, count: int) -> list[dict]:
    """`count` training prompts of one language: each document cut at `ceil(count / documents)` evenly spaced word
    starts (its start first), taken document by document until there are `count` (fewer only when the documents
    are too short)."""
    per_document = -(-count // len(documents))
    entries = []
    for text in documents:
        starts = sorted({_word_start(text, len(text) * k // per_document, lang) for k in range(per_document)})
        entries += _entries(text, lang, starts)
    return entries[:count]


def multilingual_prompts(out: Path, split: str, count: int) -> list[Path]:
    """One prompts file per non-English language (records {"prompt", "reference"}): `split` "train", count / 5
    prompts of each language from its training documents (`train_entries`); "heldout", two per held-out document
    (count is ignored)."""
    from bench.experiments.pretrained import LANGUAGES

    files = []
    for lang in LANGUAGES:
        documents = [json.loads(line)["text"] for line in
                     (MULTILINGUAL / f"{split}-{lang}.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
        entries = []
        if split == "train":
            entries = train_entries(documents, lang, max(1, count // len(LANGUAGES)))
        else:
            for text in documents:
                half = len(text) // 2
                second = next((i + 1 for i in range(half, len(text)) if text[i] in " \n"), half) if lang not in CJK else half
                entries += _entries(text, lang, [0, second])
        path = out / f"prompts-{split}-{lang}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries), encoding="utf-8")
        files.append(path)
    return files


def multilingual_base(out: Path) -> Path:
    """bench/experiments/pretrained.py's CSD student (trained there once if its export is missing)."""
    import bench.experiments.pretrained as pretrained

    target = ROOT / "out/bench-pretrained/runs" / BASE_REGIME / f"{BASE_ARM.replace(' ', '_')}-seed{BASE_SEED}"
    if not (target / "export" / "config.json").is_file():
        dirs = _heldout_dirs()
        out.mkdir(parents=True, exist_ok=True)  # base.log goes there before anything else is written
        pretrained.train_arm(BASE_REGIME, BASE_ARM, BASE_SEED, dirs, ROOT / "out/bench-pretrained",
                             pretrained.REGIMES[BASE_REGIME]["steps"], out / "base.log")
    return target / "export"


def _heldout_dirs() -> dict:
    import bench.experiments.pretrained as pretrained

    folder = ROOT / "out/bench-pretrained"
    folder.mkdir(parents=True, exist_ok=True)
    return pretrained.prepare(BASE_REGIME, folder, folder / "commands.log", False)


def multilingual_heldout(model: Path) -> dict:
    """Held-out bits per byte per language; `heldout_bits_per_byte` is the non-English mean."""
    from bench.experiments.pretrained import HELDOUT, LANGUAGES, per_language

    dirs = _heldout_dirs()
    scores = per_language(dirs, model, "student")
    return {"heldout_bits_per_byte": sum(scores[lang] for lang in LANGUAGES) / len(LANGUAGES),
            "heldout_by_language": {lang: scores[lang] for lang in HELDOUT}}
