"""speedup/prompt_sets.py: the named sets from their PyPI packages, EAGLE's question files, later turns, long
contexts; and the per set regrouping of sweep rows (speedup/per_set.py)."""

import gzip
import json
from pathlib import Path

import pytest

from eagle3lib import params
from eagle3lib.speedup import per_set, prompt_sets
from eagle3lib.workbook import plots, widgets

SHARED_BENCHSETS = Path(__file__).resolve().parents[3] / "shared" / "benchsets"


def render(messages):
    """A stand-in chat template: one token per character, so lengths are easy to reason about."""
    return [ord(c) % 256 for m in messages for c in f"<{m['role']}>{m['content']}"] + [1]


def test_named_sets_come_from_their_packages():
    mt = prompt_sets.load_set("mt_bench")
    he = prompt_sets.load_set("humaneval")
    assert len(mt) == 80 and all(len(q["turns"]) == 2 for q in mt)
    assert {q["category"] for q in mt} >= {"writing", "coding", "math", "reasoning"}
    assert len(he) == 164 and he[0]["question_id"] == "0" and he[0]["category"] == "code"
    assert he[0]["turns"][0].startswith(prompt_sets.HUMANEVAL_INSTRUCTION + "from typing import List")
    assert set(params.PROMPT_SET_NAMES) == {prompt_sets.HELD_OUT, *prompt_sets.PACKAGED}


def test_unknown_names_and_malformed_files_say_what_to_fix(tmp_path):
    with pytest.raises(params.ParamsError, match="unknown prompt set 'mtbench'"):
        params.load_params(Path(__file__).parents[2] / "params/smollm2-135m-cpu.yaml", {"bench.prompts": ["mtbench"]})
    with pytest.raises(prompt_sets.PromptSetError, match="unknown set 'gsm'"):
        prompt_sets.load_set("gsm")
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["fine"]}\n\n{"question_id": 2, "turns": "not a list"}\n')
    with pytest.raises(prompt_sets.PromptSetError, match=r"q.jsonl:3: expected an object with `turns`"):
        prompt_sets.read_questions(bad)
    bad.write_text('{"turns": ["a"]}\n{"turns": ["b"]\n')
    with pytest.raises(prompt_sets.PromptSetError, match=r"q.jsonl:2: not JSON"):
        prompt_sets.read_questions(bad)
    bad.write_text('{"question_id": 7, "turns": ["a"]}\n{"question_id": 7, "turns": ["b"]}\n')
    with pytest.raises(prompt_sets.PromptSetError, match="q.jsonl:2: question_id 7 appears twice"):
        prompt_sets.read_questions(bad)
    with pytest.raises(prompt_sets.PromptSetError, match="no file"):
        prompt_sets.load_set(str(tmp_path / "missing.jsonl"))
    a, b = tmp_path / "a" / "question.jsonl", tmp_path / "b" / "a.jsonl"
    for f in (a, b):
        f.parent.mkdir()
        f.write_text('{"turns": ["x"]}\n')
    with pytest.raises(prompt_sets.PromptSetError, match=r"labelled \['a'\]"):
        prompt_sets.check_entries([str(a), str(b)])


def test_files_relative_to_the_params_folder_and_gzip(tmp_path):
    (tmp_path / "sets").mkdir()
    with gzip.open(tmp_path / "sets" / "mine.jsonl.gz", "wt") as f:
        f.write(json.dumps({"question_id": "q1", "category": "math", "turns": ["1+1?"]}) + "\n")
    entry = "sets/mine.jsonl.gz"
    assert prompt_sets.set_name(entry) == "mine"
    prompts = prompt_sets.build_prompts(render, [entry], 5, [], base_dir=tmp_path)
    assert [(p["id"], p["set"], p["category"]) for p in prompts] == [("mine/q1", "mine", "math")]


def test_later_turns_follow_the_targets_own_answer():
    held_out = [{"id": "h1", "messages": [{"role": "user", "content": "hi"}], "reference": "hello"}]
    prompts = prompt_sets.build_prompts(render, ["held_out", "mt_bench"], 2, held_out)
    # the categories take turns: MT-Bench's file starts with ten writing questions, then ten roleplay
    assert [p["id"] for p in prompts] == ["held_out/h1", "mt_bench/81", "mt_bench/81#2", "mt_bench/91", "mt_bench/91#2"]
    assert [p["category"] for p in prompts[1::2]] == ["writing", "roleplay"]
    assert prompts[2]["prompt_ids"] is None and prompts[2]["after"] == "mt_bench/81"
    asked = []

    def answer(turns):
        asked.extend(t["id"] for t in turns)
        return [{"text": f"answer to {t['id']}"} for t in turns]

    prompt_sets.complete_turns(prompts, answer, render)
    assert asked == ["mt_bench/81", "mt_bench/91"]
    second = prompts[2]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == "answer to mt_bench/81"
    assert second["messages"][2]["content"].startswith("Rewrite your previous response")
    assert second["prompt_ids"] == render(second["messages"])
    assert prompt_sets.prompt_texts(prompts)["mt_bench/81#2"] == second["messages"][2]["content"]


def test_the_first_questions_cover_every_category():
    eight = prompt_sets.across_categories(prompt_sets.load_set("mt_bench"))[:8]
    assert len({q["category"] for q in eight}) == 8
    qs = [{"question_id": str(i), "category": c, "turns": ["x"]} for i, c in enumerate("aabbbc")]
    assert [q["question_id"] for q in prompt_sets.across_categories(qs)] == ["0", "2", "5", "1", "3", "4"]


def test_quick_subsets_take_every_set_in_turn():
    prompts = [{"id": f"{s}/{i}", "set": s} for s in ("a", "b") for i in range(4)] + [{"id": "c/0", "set": "context"}]
    assert [p["id"] for p in prompt_sets.take(prompts, 4)] == ["a/0", "a/1", "b/0", "b/1"]
    assert "c/0" not in [p["id"] for p in prompt_sets.take(prompts, 9)]


def test_long_contexts_are_made_of_held_out_conversations():
    held_out = [
        {"id": f"h{i}", "messages": [{"role": "user", "content": f"question {i} " * 20}], "reference": "reply " * 50}
        for i in range(8)
    ]
    prompts = prompt_sets.context_prompts(render, held_out, [1000, 3000], 2)
    assert [p["id"] for p in prompts] == ["context/1000/h0", "context/1000/h1", "context/3000/h0", "context/3000/h1"]
    for p in prompts:
        n = len(p["prompt_ids"])
        assert p["context_target"] - 600 < n <= p["context_target"], n  # filled to within one conversation
        assert p["messages"][-1] == held_out[int(p["id"][-1])]["messages"][-1]  # the question comes last
        assert p["category"] == prompt_sets.context_bucket(n)
        history = [m["content"] for m in p["messages"][:-1] if m["role"] == "user"]
        assert p["messages"][-1]["content"] not in history  # its own conversation is not in its history
    assert [prompt_sets.context_bucket(n) for n in (10, 1024, 5000, 20000)] == ["<1k", "1-4k", "4-16k", ">=16k"]


@pytest.mark.skipif(not SHARED_BENCHSETS.is_dir(), reason="../shared/benchsets is not beside the checkout")
def test_shared_benchsets_read_as_user_files():
    for name in ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa"):
        path = SHARED_BENCHSETS / name / "question.jsonl"
        qs = prompt_sets.load_set(str(path))
        assert prompt_sets.set_name(str(path)) == name and len(qs) in (79, 80), (name, len(qs))
    assert prompt_sets.load_set(str(SHARED_BENCHSETS / "mt_bench" / "question.jsonl")) == prompt_sets.load_set(
        "mt_bench"
    )


def _vllm_part(drafts, accepted_per_pos):
    return {"drafts": drafts, "draft_tokens": drafts * len(accepted_per_pos), "accepted": sum(accepted_per_pos),
            "prefill_s": 0.0, "decode_s": 0.0, "accepted_per_pos": accepted_per_pos}  # fmt: skip


def test_per_set_tables_regroup_rows(tmp_path):
    """Sets, categories and context buckets from rows shaped as configuration.measure writes them."""

    def figures(tps, al=None, requests=2):
        return {"requests": requests, "tokens_per_s": tps, "accept_len": al}

    reqs = [
        {"id": "mt/1", "set": "mt", "category": "math", "prompt_tokens": 100},
        {"id": "mt/2", "set": "mt", "category": "writing", "prompt_tokens": 200},
        {"id": "context/2048/h", "set": "context", "category": "1-4k", "prompt_tokens": 2000},
    ]
    parts = [_vllm_part(10, [8, 4]), _vllm_part(10, [2, 0]), _vllm_part(10, [5, 1])]
    rows = [
        {"engine": "vllm", "depth": 0, "concurrency": 1, "sets": {"mt": figures(10.0), "context": figures(5.0)}},
        {"engine": "vllm", "depth": 2, "concurrency": 1, "sets": {"mt": figures(13.0, 1.7) | {"speedup": 1.3},
         "context": figures(5.5, 1.6) | {"speedup": 1.1}}, "request_figures": reqs, "request_parts": parts},
    ]  # fmt: skip
    table = per_set.set_table(rows, 1, {"mt": {"accept_len_at": {"2": 1.8}}})
    assert table["depths"] == [2]
    mt = table["sets"][0]
    assert mt["set"] == "mt" and mt["cells"][2] == {
        "accept_len": 1.7, "speedup": 1.3, "requests": 2, "predicted_accept_len": 1.8,
    }  # fmt: skip
    assert per_set.predicted_against_measured(table)[0]["within_15pct"] is True
    cats = {tuple(g["group"]): g["cells"][2]["accept_len"] for g in per_set.category_table(rows)}
    assert cats == {("mt", "math"): pytest.approx(2.2), ("mt", "writing"): pytest.approx(1.2),
                    ("context", "1-4k"): pytest.approx(1.6)}  # fmt: skip
    ctx = per_set.context_table(rows)
    assert [g["group"] for g in ctx] == ["<1k", "1-4k"]
    assert ctx[0]["cells"][2]["accept_len"] == pytest.approx(1 + 14 / 20) and ctx[0]["cells"][2]["requests"] == 2
    page = widgets.set_table_html(table)
    assert "<th colspan=3>depth 2</th>" in page and "1.30x" in page and "1.80" in page
    assert widgets.set_tables_html([table, table]).count("<caption>concurrency 1</caption>") == 2
    assert "math" in widgets.grouped_acceptance_html(per_set.category_table(rows), "set / category")
    plots.bench_context(ctx).savefig(tmp_path / "c.png")


def test_prompts_longer_than_the_engines_context_are_left_out_before_the_sweep(capsys):
    """vLLM at --max-model-len 2048 refused a 2,616-token held-out prompt mid-sweep (HTTP 400) on a tiny Kimi run;
    the engine's own limit now counts beside the target's, and a question-set prompt over it (with its later
    turns) is left out for every configuration alike, a long-context one refused."""
    from types import SimpleNamespace

    from eagle3lib.params import EngineParams
    from eagle3lib.speedup import notebook

    config = SimpleNamespace(max_position_embeddings=262144)
    short = {"id": "a", "set": "held_out", "prompt_ids": [1] * 100}
    long_ = {"id": "b", "set": "mt_bench", "prompt_ids": [1] * 2616}
    its_turn = {"id": "b#2", "set": "mt_bench", "prompt_ids": None, "after": "b"}
    engine = EngineParams(name="vllm", extra_args=["--enforce-eager", "--max-model-len", "2048"])
    kept = notebook.check_context([short, long_, its_turn], config, 64, engine)
    assert kept == [short]
    assert (
        "2 of 3 prompt(s) left out: longer than vllm's context (engine.extra_args) of 2048" in capsys.readouterr().out
    )
    assert notebook.check_context([short, long_], config, 64, EngineParams(name="sglang")) == [short, long_]
    sglang = EngineParams(name="sglang", extra_args=["--context-length=1024"])
    with pytest.raises(ValueError, match="1 long-context prompt"):
        notebook.check_context([short, {**long_, "set": prompt_sets.CONTEXT}], config, 64, sglang)
