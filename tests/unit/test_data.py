import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3lib.prepare import conversations as D
from eagle3lib.prepare import regenerate as R
from eagle3lib.prepare import sources as S
from eagle3lib.prepare.sizing import TokenBudget


def sharegpt(cid, *turns):
    roles = ["human", "gpt"]
    return {"id": cid, "conversations": [{"from": roles[i % 2], "value": t} for i, t in enumerate(turns)]}


def conv(cid, *turns):
    roles = ["user", "assistant"]
    return {"id": cid, "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


# ---------------------------------------------------------------------------------------------
# Loading


def test_embedded_sharegpt_with_limit():
    convs, stats = S.load_conversations(S.EMBEDDED_DATA, limit=500)
    assert len(convs) == 500 and stats["kept"] == 500 and stats["stopped_at_limit"]
    assert stats["read"] >= 500 and stats["truncated_sources"] == []
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert set(roles) <= {"system", "user", "assistant"} and "assistant" in roles
        assert [r for r in roles if r != "system"][0] == "user"
        assert isinstance(c["id"], str) and all(m["content"].strip() for m in c["messages"])
    assert convs[0]["id"] == "QWJhYvA_0"


def test_embedded_sharegpt_whole_file_is_truncated():
    convs, stats = S.load_conversations(S.EMBEDDED_DATA)
    assert stats["truncated_sources"] == [S.EMBEDDED_DATA] and stats["skipped"]["truncated tail"] == 1
    assert stats["kept"] == len(convs) > 17000
    assert stats["read"] == stats["kept"] + sum(stats["skipped"].values())
    assert stats["unknown_roles"] == {"bing": 4}


def test_json_array_tolerant(tmp_path):
    records = [
        sharegpt("a", "hi", "hello"),
        {
            "id": "b",
            "conversations": [
                {"from": "gpt", "value": "leading"},
                {"from": "human", "value": "q"},
                {"from": "chatgpt", "value": "r"},
            ],
        },
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "sys"},
                {"from": "user", "value": "q"},
                {"from": "bard", "value": "r"},
            ],
        },
        sharegpt("no-answer", "only a question"),
        {"id": "bad-role", "conversations": [{"from": "human", "value": "q"}, {"from": "bing", "value": "r"}]},
        sharegpt("empty-turn", "q", "   "),
        {"id": "empty", "conversations": []},
        {"conversations": [{"from": "human", "value": "no id"}, {"from": "gpt", "value": "ok"}]},
        {"id": "m", "messages": [{"role": "user", "content": "openai style"}, {"role": "assistant", "content": "ok"}]},
        sharegpt("broken", "x", "y"),
        sharegpt("after-broken", "still", "read"),
        sharegpt("cut", "this one", "is cut in the middle of its text"),
    ]
    text = json.dumps(records, indent=2)
    text = text.replace('"value": "x"', '"value": x"', 1)  # malformed element in the middle
    text = text[: text.index("in the middle of")]  # truncated tail, as in the embedded file
    path = tmp_path / "sg.json"
    path.write_text(text)

    convs, stats = S.load_conversations(str(path))
    ids = [c["id"] for c in convs]
    assert ids[:3] == ["a", "b", "c"] and ids[4:] == ["m", "after-broken"]
    assert ids[3].startswith("sha-")
    assert convs[1]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    assert [m["role"] for m in convs[2]["messages"]] == ["system", "user", "assistant"]
    assert stats["skipped"] == {
        "empty": 2,
        "malformed JSON": 1,
        "no assistant turn": 1,
        "truncated tail": 1,
        "unknown role": 1,
    }
    assert stats["truncated_sources"] == [str(path)] and stats["unknown_roles"] == {"bing": 1}
    assert stats["read"] == len(records)

    # the same data read in small pieces (elements straddle buffer ends) gives the same result
    old = S._CHUNK
    try:
        S._CHUNK = 7
        assert S.load_conversations(str(path)) == (convs, stats)
    finally:
        S._CHUNK = old

    limited, s = S.load_conversations([str(path), str(path)], limit=2)
    assert [c["id"] for c in limited] == ["a", "b"] and s["stopped_at_limit"]
    both, s = S.load_conversations([str(path), str(path)])
    assert len(both) == 2 * len(convs)


def test_jsonl(tmp_path):
    lines = [
        json.dumps(sharegpt("a", "q", "r")),
        "{not json",
        json.dumps(sharegpt("b", "q2", "r2")),
        json.dumps(sharegpt("c", "q3", "r3"))[:20],
    ]
    path = tmp_path / "sg.jsonl"
    path.write_text("\n".join(lines))
    convs, stats = S.load_conversations(str(path))
    assert [c["id"] for c in convs] == ["a", "b"]
    assert stats["skipped"] == {"malformed JSON": 1, "truncated tail": 1}
    assert stats["truncated_sources"] == [str(path)]

    path.write_text("\n".join(lines[:3]) + "\n")
    assert S.load_conversations(str(path))[1]["truncated_sources"] == []


@pytest.mark.parametrize("suffix", [".json.xz", ".json.gz", ".jsonl.bz2"])
def test_compressed_files_are_read_like_plain_ones(tmp_path, suffix):
    import bz2  # noqa: E401
    import gzip
    import lzma

    records = [sharegpt("a", "q", "r"), sharegpt("b", "q2", "r2")]
    text = "\n".join(json.dumps(r) for r in records) if "jsonl" in suffix else json.dumps(records)
    opener = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}["." + suffix.rsplit(".", 1)[1]]
    with opener(tmp_path / f"sg{suffix}", "wt", encoding="utf-8") as f:
        f.write(text)
    convs, stats = S.load_conversations(str(tmp_path / f"sg{suffix}"))
    assert [c["id"] for c in convs] == ["a", "b"] and stats["skipped"] == {}


def test_a_source_with_no_usable_conversation_is_an_error(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xfd7zXZ\x00 not json at all\n{also not}\n")
    with pytest.raises(ValueError, match="No usable conversation.*malformed JSON"):
        S.load_conversations(str(path))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        S.load_conversations(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match=S.EMBEDDED_DATA):
        S.load_conversations("embedded:other")


# ---------------------------------------------------------------------------------------------
# Splitting


def test_split_deterministic_and_disjoint():
    convs = [conv(f"c{i}", f"question {i}", f"answer {i}") for i in range(300)]
    convs += [conv("dup", "hi", "hello"), conv("dup", "hi", "hello"), conv("hi-again", "hi", "hey")]
    convs += [conv(f"cont{i}", "continue", f"more {i}") for i in range(5)]
    s1 = D.split_conversations(convs, val_fraction=0.1, bench_count=20, seed=0)
    shuffled = convs[:]
    random.Random(1).shuffle(shuffled)
    s2 = D.split_conversations(shuffled, val_fraction=0.1, bench_count=20, seed=0)
    assert s1 == s2

    ids = {k: [c["id"] for c in v] for k, v in s1.items()}
    assert len(ids["bench"]) == 20
    all_ids = ids["train"] + ids["val"] + ids["bench"]
    assert len(all_ids) == len(set(all_ids)) == 300 + 2 + 5
    assert 10 <= len(ids["val"]) <= 50
    bench_prompts = {c["messages"][0]["content"] for c in s1["bench"]}
    assert not bench_prompts & {"hi", "continue"}  # shared prompts are never bench prompts
    for c in s1["train"] + s1["val"]:
        assert not bench_prompts & {m["content"] for m in c["messages"] if m["role"] == "user"}

    s3 = D.split_conversations(convs, val_fraction=0.1, bench_count=20, seed=1)
    assert [c["id"] for c in s3["bench"]] != ids["bench"]
    with pytest.raises(ValueError, match="val_fraction"):
        D.split_conversations(convs, 1.0, 0, 0)


def test_keep_unseen_leaves_out_the_other_runs_val_and_bench(tmp_path):
    """smollm2-135m-gpu-release.yaml (the released drafter's run) reads more of the same data than smollm2-135m-cpu.yaml
    and splits it otherwise; data.keep_unseen leaves out tiny's val and bench conversations, by id and by prompt,
    so none of them reaches the release's splits. Shown on the real files, with the release's read cut to 1,200
    conversations (the first 320 are tiny's own)."""
    from eagle3lib.params import ParamsError, load_params
    from eagle3lib.prepare import notebook

    root = Path(__file__).resolve().parents[2] / "params"
    release = load_params(root / "smollm2-135m-gpu-release.yaml", {"data.max_conversations": 1200})
    assert release.data.keep_unseen == [str(root / "smollm2-135m-cpu.yaml")]
    tiny = load_params(root / "smollm2-135m-cpu.yaml")
    theirs, _ = S.load_conversations(tiny.data.sources, limit=tiny.data.max_conversations)
    tiny_split = D.split_conversations(theirs, tiny.data.val_fraction, tiny.data.bench_count, tiny.run.seed)
    held_out = tiny_split["val"] + tiny_split["bench"]
    held_ids = {c["id"] for c in held_out}
    held_prompts = {t for c in held_out for t in D.user_texts(c)}

    pool, stats = notebook.load_pool(release)
    split = D.split_conversations(pool, release.data.val_fraction, release.data.bench_count, release.run.seed)
    ours = [c for part in split.values() for c in part]
    assert not held_ids & {c["id"] for c in ours}
    assert not held_prompts & {t for c in ours for t in D.user_texts(c)}
    left_out = stats["kept_unseen"][str(root / "smollm2-135m-cpu.yaml")]
    assert left_out >= len(held_ids) > 0 and len(pool) == 1200 - left_out
    # without keep_unseen the same read would have trained on some of them
    plain, _ = S.load_conversations(release.data.sources, limit=1200)
    plain_split = D.split_conversations(plain, release.data.val_fraction, release.data.bench_count, release.run.seed)
    assert held_ids & {c["id"] for c in plain_split["train"]}
    with pytest.raises(ParamsError, match="data.keep_unseen: no params file at .*nope.yaml"):
        load_params(root / "smollm2-135m-gpu-release.yaml", {"data.keep_unseen": ["nope.yaml"]})


def test_split_bench_excludes_same_prompt_from_train():
    convs = [conv(f"c{i}", f"q{i}", "a") for i in range(50)]
    split = D.split_conversations(convs, 0.0, 1, seed=0)
    prompt = split["bench"][0]["messages"][0]["content"]
    leak = {
        "id": "leak",
        "messages": [
            {"role": "user", "content": "other"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": "y"},
        ],
    }
    split2 = D.split_conversations(convs + [leak], 0.0, 1, seed=0)
    assert split2["bench"] == split["bench"]
    assert "leak" not in [c["id"] for c in split2["train"]]


# ---------------------------------------------------------------------------------------------
# Chat template and loss mask (real SmolLM2 tokenizer)


def masked_runs(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


MESSAGES = [
    {"role": "system", "content": "You answer like a pirate."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Arr, 'tis 4, matey."},
    {"role": "user", "content": "And the capital of France?\n"},
    {"role": "assistant", "content": "\nParis, ye landlubber!\n\n"},
]


def test_loss_mask_multi_turn_with_system(embedded_target):
    tok = embedded_target[1]
    ((ids, mask),) = D.tokenize_conversation(tok, MESSAGES, max_seq_len=4096)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    # the rendered text, each piece tokenized as the engine sees it: the prompt, then what the model writes
    # ("\n" at the end of the prompt stays its own token before a reply that starts with "\n")
    assert tok.decode(ids) == tok.apply_chat_template(MESSAGES, tokenize=False)
    plain = [m | {"content": m["content"].strip()} for m in MESSAGES]
    assert (
        D.tokenize_conversation(tok, plain, 4096)[0][0] == tok.apply_chat_template(plain, return_dict=True)["input_ids"]
    )
    # masked: exactly each assistant reply followed by <|im_end|>; the template's "\n" after it is not
    assert masked_runs(tok, ids, mask) == ["Arr, 'tis 4, matey.<|im_end|>", "\nParis, ye landlubber!\n\n<|im_end|>"]
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in MESSAGES[:2] + MESSAGES[3:4]:
        assert m["content"] in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_loss_mask_default_system_prompt(embedded_target):
    tok = embedded_target[1]
    ((ids, mask),) = D.tokenize_conversation(tok, MESSAGES[1:3], max_seq_len=4096)
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(ids)  # added by the template
    assert masked_runs(tok, ids, mask) == ["Arr, 'tis 4, matey.<|im_end|>"]


def test_truncation(embedded_target):
    tok = embedded_target[1]
    ((full_ids, full_mask),) = D.tokenize_conversation(tok, MESSAGES, max_seq_len=4096)
    ((ids, mask),) = D.tokenize_conversation(tok, MESSAGES, max_seq_len=40)
    assert len(ids) == len(mask) == 40
    assert (ids, mask) == (full_ids[:40], full_mask[:40])


def test_a_template_that_rewrites_earlier_turns_gets_a_sequence_per_turn(embedded_target):
    """A template that marks the last message renders turn 1 differently once turn 2 follows: each turn is then
    trained in the context the model is given for it, a sequence each, and each turn's loss covers what the
    model writes there."""
    tok = embedded_target[1]
    saved = tok.chat_template
    try:
        tok.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
        sequences = D.tokenize_conversation(tok, MESSAGES, 4096)
        assert len(sequences) == 2
        assert [masked_runs(tok, *s) for s in sequences] == [
            ["Arr, 'tis 4, matey. (last)<|im_end|>"],
            ["\nParis, ye landlubber!\n\n (last)<|im_end|>"],
        ]
        assert tok.decode(sequences[1][0]).startswith("<|im_start|>system\nYou answer like a pirate.<|im_end|>")
        assert "What is 2+2? (last)" in tok.decode(sequences[0][0])  # turn 1's context: the user's was last
        assert "What is 2+2?<|im_end|>" in tok.decode(sequences[1][0])
        split = D.tokenize_split(tok, [{"id": "pirate", "messages": MESSAGES}], 4096, progress=False)
        assert split["ids"] == ["pirate", "pirate#1"]
    finally:
        tok.chat_template = saved


def test_a_template_without_a_generation_prompt_is_refused(embedded_target):
    tok = embedded_target[1]
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        with pytest.raises(ValueError, match="generation prompt"):
            D.tokenize_conversation(tok, MESSAGES, 4096)
    finally:
        tok.chat_template = saved


def test_tokenize_split_and_token_file_round_trip(tmp_path, embedded_target):
    tok = embedded_target[1]
    convs = [
        {"id": "pirate", "messages": MESSAGES},
        conv("short", "Hi", "Hello!"),
        conv("long-question", "word " * 300, "answer"),
    ]
    tokens = D.tokenize_split(tok, convs, max_seq_len=64, progress=False)
    assert tokens["ids"] == ["pirate", "short"]  # the long question leaves no loss token in 64
    assert tokens["stats"]["skipped_no_loss_tokens"] == 1
    assert tokens["input_ids"].dtype == torch.int32 and tokens["loss_mask"].dtype == torch.uint8
    assert tokens["seq_starts"].dtype == torch.int64 and tokens["seq_starts"].tolist()[0] == 0
    s = tokens["seq_starts"].tolist()
    assert s[-1] == len(tokens["input_ids"]) == tokens["stats"]["tokens"]
    ((ids1, mask1),) = D.tokenize_conversation(tok, convs[1]["messages"], 64)
    assert tokens["input_ids"][s[1] : s[2]].tolist() == ids1 and tokens["loss_mask"][s[1] : s[2]].tolist() == mask1

    path = D.save_tokens(tmp_path / "train.safetensors", tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["train.safetensors"]
    back = D.load_tokens(path)
    assert back["ids"] == tokens["ids"] and back["stats"] == tokens["stats"]
    for k in ("input_ids", "loss_mask", "seq_starts"):
        assert torch.equal(back[k], tokens[k]) and back[k].dtype == tokens[k].dtype


# ---------------------------------------------------------------------------------------------
# Regeneration


REGEN_CONVS = [
    {
        "id": "two-turns",
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Spain?"},
            {"role": "assistant", "content": "Madrid."},
        ],
    },
    {
        "id": "system",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "hi"},
        ],
    },
    conv("count", "Count to three.", "1 2 3"),
    conv("color", "Name a color.", "Blue."),
    conv("late", "What is 1+1?", "2"),
]


def test_a_reply_ends_at_the_first_eos_whoever_generated_it():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    eos = {0, 9}
    assert R._reply(Tok(), [5, 6, 9, 0, 0], eos) == ("5 6", 3, True)  # hf: eos, then padding
    assert R._reply(Tok(), [5, 6, 7], eos) == ("5 6 7", 3, False)  # hf: ran into max_new_tokens
    assert R._reply(Tok(), [5, 6], eos, "stop") == ("5 6", 3, True)  # engine: left the eos out
    assert R._reply(Tok(), [5, 6, 7], eos, "length") == ("5 6 7", 3, False)


def test_regeneration_resumes_to_the_same_result(tmp_path, embedded_target):
    model, tok = embedded_target
    kw = dict(budget_tokens=30, max_new_tokens=8, batch_size=2, progress=False)
    a = tmp_path / "a.jsonl"
    stats = R.regenerate_responses(model, tok, REGEN_CONVS, a, **kw)
    assert stats["budget_exhausted"] and stats["kept_original"] >= 1
    assert stats["tokens_generated"] >= 30 and stats["tokens_per_s"] > 0
    assert tok.padding_side == "right"  # restored
    recs = [json.loads(line) for line in a.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["two-turns", "system", "count", "color"]  # batch 2 is past the budget
    assert recs[0]["regenerated"] and recs[0]["messages"][0] == REGEN_CONVS[0]["messages"][0]
    assert recs[0]["messages"][1]["content"] != "Paris."

    # "kill" mid-write: keep batch 0 and the first line of batch 1, tear the second line of batch 1
    b = tmp_path / "b.jsonl"
    text = a.read_text()
    cut = len("".join(text.splitlines(keepends=True)[:3])) + 25
    b.write_text(text[:cut])
    stats_b = R.regenerate_responses(model, tok, REGEN_CONVS, b, **kw)
    assert b.read_text() == text
    assert stats_b["tokens_generated"] == stats["tokens_generated"]
    assert stats_b["tokens_generated_this_run"] == recs[3]["generated_tokens"]

    # finished file: rerun does nothing
    stats_c = R.regenerate_responses(model, tok, REGEN_CONVS, b, **kw)
    assert stats_c["tokens_generated_this_run"] == 0 and b.read_text() == text

    merged = R.apply_regenerated(REGEN_CONVS, a)
    assert [c["id"] for c in merged] == [c["id"] for c in REGEN_CONVS]
    assert merged[0]["messages"] == recs[0]["messages"] and merged[4] == REGEN_CONVS[4]
    assert set(R.read_regenerated(a)) == {"two-turns", "system", "count", "color"}

    with pytest.raises(ValueError, match="settings"):
        R.regenerate_responses(model, tok, REGEN_CONVS, a, **{**kw, "max_new_tokens": 9})


class GreedyServer:
    """The engine backend's server interface (generate on token ids, stop ids, finish reason), answered by
    transformers' greedy generate in this process, one request at a time; the real engines are in
    test_engines.py (vLLM CPU: the same records as hf)."""

    def __init__(self, model):
        self.model, self.lock, self.requests, self.prompts = model, threading.Lock(), 0, set()

    def generate(self, prompt_ids, max_tokens, ignore_eos=True, stop_token_ids=None):
        with self.lock, torch.no_grad():
            self.requests += 1
            self.prompts.add(tuple(prompt_ids))
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                num_beams=1,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=stop_token_ids,
                pad_token_id=stop_token_ids[0],
            )
        ids = out[0, len(prompt_ids) :].tolist()
        stopped = bool(ids) and ids[-1] in stop_token_ids
        return {"token_ids": ids, "finish_reason": "stop" if stopped else "length"}


def test_engine_regeneration_window_budget_and_resume(tmp_path, embedded_target):
    model, tok = embedded_target
    kw = dict(max_new_tokens=8, batch_size=2, progress=False, backend="engine:test")
    free = R.regenerate_responses(
        model, tok, REGEN_CONVS, tmp_path / "free.jsonl", budget_tokens=10_000, engine=GreedyServer(model), **kw
    )
    hf = R.regenerate_responses(
        model,
        tok,
        REGEN_CONVS,
        tmp_path / "hf.jsonl",
        budget_tokens=10_000,
        max_new_tokens=8,
        batch_size=2,
        progress=False,
    )
    assert not free["budget_exhausted"] and R.read_regenerated(tmp_path / "free.jsonl") == R.read_regenerated(
        tmp_path / "hf.jsonl"
    )  # the same greedy replies, turn for turn
    assert {k: free[k] for k in ("regenerated", "turns_regenerated", "tokens_generated", "stops")} == {
        k: hf[k] for k in ("regenerated", "turns_regenerated", "tokens_generated", "stops")
    }
    spent = [json.loads(line)["generated_tokens"] for line in (tmp_path / "free.jsonl").read_text().splitlines()]

    # Conversation i starts only while conversations 0..i-2 (window 2) spent less than the budget.
    budget = spent[0] + spent[1]
    a = tmp_path / "a.jsonl"
    stats = R.regenerate_responses(model, tok, REGEN_CONVS, a, budget_tokens=budget, engine=GreedyServer(model), **kw)
    started = [c["id"] for i, c in enumerate(REGEN_CONVS) if sum(spent[: max(0, i - 1)]) < budget]
    assert (
        [json.loads(line)["id"] for line in a.read_text().splitlines()] == started == [c["id"] for c in REGEN_CONVS[:3]]
    )
    assert stats["budget_exhausted"] and stats["tokens_generated"] == sum(spent[:3])

    # torn after one line and a half: the rerun writes the same file, asking only for what is missing (conversation
    # 3 may start on a free slot before conversation 1 is back, and is dropped unwritten once the rule refuses it)
    b = tmp_path / "b.jsonl"
    text = a.read_text()
    b.write_text(text[: len(text.splitlines(keepends=True)[0]) + 30])
    server = GreedyServer(model)
    again = R.regenerate_responses(model, tok, REGEN_CONVS, b, budget_tokens=budget, engine=server, **kw)
    assert b.read_text() == text and again["tokens_generated_this_run"] == sum(spent[1:3])
    first = GreedyServer(model)
    R.regenerate_responses(model, tok, REGEN_CONVS[:1], tmp_path / "0.jsonl", budget_tokens=budget, engine=first, **kw)
    assert first.prompts and server.prompts.isdisjoint(first.prompts)  # the written conversation is not asked again
    assert server.requests >= sum(json.loads(line)["turns_regenerated"] for line in text.splitlines()[1:])


def test_an_engine_regeneration_fills_a_slot_freed_behind_a_long_conversation(tmp_path, embedded_target):
    """Engines: a conversation starts as soon as a slot is free, not once the conversation a window before it has
    finished (a long one held the other slot idle: 60 of 256 in flight on average over ShareGPT); the records are
    still written in input order, the same as one at a time."""
    model, tok = embedded_target
    long = {"id": "long", "messages": [{**m, "content": "Zebra. " + m["content"]} for m in REGEN_CONVS[0]["messages"]]}
    convs = [long] + [{**c, "id": f"{c['id']}-{i}"} for i, c in enumerate(REGEN_CONVS[1:] * 2)]
    events, lock = [], threading.Lock()

    class Timed(GreedyServer):  # the long conversation's two turns take 2 s each, the others' none added
        def generate(self, prompt_ids, max_tokens, ignore_eos=True, stop_token_ids=None):
            kind = "long" if "Zebra" in tok.decode(prompt_ids) else "short"
            with lock:
                events.append(("start", kind))
            time.sleep(2.0 if kind == "long" else 0.0)
            out = super().generate(prompt_ids, max_tokens, ignore_eos, stop_token_ids)
            with lock:
                events.append(("end", kind))
            return out

    kw = dict(max_new_tokens=8, batch_size=2, progress=False, backend="engine:test", budget_tokens=10_000)
    R.regenerate_responses(model, tok, convs, tmp_path / "a.jsonl", engine=Timed(model), **kw)
    ids = [json.loads(line)["id"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert ids == [c["id"] for c in convs]
    long_done = max(i for i, e in enumerate(events) if e == ("end", "long"))
    shorts_meanwhile = sum(e == ("start", "short") for e in events[:long_done])
    # in-order starts run conversation 1 alone beside it (1 request) and conversation 2 only after it
    assert shorts_meanwhile >= 2
    R.regenerate_responses(
        model, tok, convs, tmp_path / "b.jsonl", engine=GreedyServer(model), **kw | {"batch_size": 1}
    )
    assert R.read_regenerated(tmp_path / "b.jsonl") == R.read_regenerated(tmp_path / "a.jsonl")


def test_the_regeneration_budget_cut_to_its_minutes():
    """data.regenerate.max_minutes: r tokens/s for the minutes, less one window in flight, at most the asked budget,
    from the index after the probe; recorded so that a resume starts conversations against the same budget."""
    budget = TokenBudget(20_000, 3.0)
    assert budget.pending and budget.at(40) == 20_000 and budget.record() == {}
    budget.decide(32, tokens=3_000, seconds=50.0, conversations=32, tail_tokens=2_300)
    assert budget.sized == 60 * 180 - 2_300 and not budget.pending
    assert budget.at(31) == 20_000 and budget.at(32) == budget.at(300) == 8_500
    assert budget.record() == {"sized_budget": {"tokens": 8_500, "from": 32}}
    assert budget.as_dict()["text"] == (
        "regeneration sized to 8,500 of 20,000 tokens: 60.0 tokens/s over the first 32 conversations, "
        "3 min (data.regenerate.max_minutes)"
    )
    resumed = TokenBudget.from_records(20_000, 3.0, [{"id": "a"}, {"id": "b", **budget.record()}])
    assert (resumed.at(31), resumed.at(32), resumed.pending) == (20_000, 8_500, False)
    assert "as sized by the run it resumed" in resumed.text()
    fast = TokenBudget(20_000, 3.0)
    fast.decide(8, tokens=9_000, seconds=10.0, conversations=8, tail_tokens=2_000)
    assert fast.sized == 20_000 and fast.text().startswith("regeneration not cut: all 20,000 tokens fit")
    unlimited = TokenBudget.from_records(20_000, None, [{"sized_budget": {"tokens": 5, "from": 0}}])
    assert not unlimited.pending and unlimited.at(99) == 20_000 and unlimited.as_dict() is None


class SlowServer(GreedyServer):
    """A server this many seconds slower a request: a machine too slow for the regeneration's minutes."""

    def __init__(self, model, seconds: float):
        super().__init__(model)
        self.seconds = seconds

    def generate(self, *args, **kwargs):
        time.sleep(self.seconds)
        return super().generate(*args, **kwargs)


def test_a_regeneration_out_of_minutes_stops_after_its_first_window_and_resumes_with_that_budget(
    tmp_path, embedded_target
):
    """Engines: the cut is decided when the first window of conversations has finished and applies from the next
    start on; a resume reads it back instead of measuring again (a recorded budget raised by hand is obeyed)."""
    model, tok = embedded_target
    kw = dict(max_new_tokens=8, batch_size=2, progress=False, backend="engine:test", budget_tokens=10_000)
    kw |= {"max_minutes": 0.001}  # 0.06 s: less than one window takes at 0.2 s a request
    a = tmp_path / "a.jsonl"
    stats = R.regenerate_responses(model, tok, REGEN_CONVS, a, engine=SlowServer(model, 0.2), **kw)
    lines = [json.loads(line) for line in a.read_text().splitlines()]
    # conversation 2 started before the cut (after conversation 0 finished), conversation 3 was the first refused
    assert [r["id"] for r in lines] == [c["id"] for c in REGEN_CONVS[:3]]
    assert "sized_budget" not in lines[0] and lines[1]["sized_budget"] == lines[2]["sized_budget"] == {
        "tokens": 0,
        "from": 3,
    }
    sizing = stats["sizing"]
    assert stats["budget_exhausted"] and sizing["sized_tokens"] == 0 and sizing["probe"]["conversations"] == 2
    assert sizing["text"].startswith("regeneration sized to 0 of 10,000 tokens") and sizing["tokens_per_s"] > 0

    text = a.read_text()  # torn in the last line: the rerun writes the same file, measuring nothing
    b = tmp_path / "b.jsonl"
    b.write_text(text[: len("".join(text.splitlines(keepends=True)[:2])) + 20])
    server = SlowServer(model, 0.2)
    again = R.regenerate_responses(model, tok, REGEN_CONVS, b, engine=server, **kw)
    assert b.read_text() == text and server.requests == lines[2]["turns_regenerated"]
    assert again["sizing"]["text"] == "regeneration budget 0 of 10,000 tokens, as sized by the run it resumed"

    raised = text.replace('"sized_budget": {"tokens": 0,', '"sized_budget": {"tokens": 10000,')
    c = tmp_path / "c.jsonl"
    c.write_text(raised)
    more = R.regenerate_responses(model, tok, REGEN_CONVS, c, engine=SlowServer(model, 0.2), **kw)
    assert not more["budget_exhausted"] and len(c.read_text().splitlines()) == len(REGEN_CONVS)


def test_hf_regeneration_out_of_minutes_stops_after_its_first_batch(tmp_path, embedded_target):
    model, tok = embedded_target

    def slow(*args):
        time.sleep(0.3)
        return R._generate(*args)

    kw = dict(budget_tokens=10_000, max_new_tokens=8, batch_size=2, progress=False, max_minutes=0.001)
    stats = R.regenerate_responses(model, tok, REGEN_CONVS, tmp_path / "a.jsonl", generate=slow, **kw)
    lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["id"] for r in lines] == [c["id"] for c in REGEN_CONVS[:2]]
    assert all(r["sized_budget"] == {"tokens": 0, "from": 1} for r in lines) and stats["budget_exhausted"]
    unlimited = R.regenerate_responses(
        model, tok, REGEN_CONVS, tmp_path / "b.jsonl", generate=slow, **kw | {"max_minutes": None}
    )
    assert unlimited["sizing"] is None and len((tmp_path / "b.jsonl").read_text().splitlines()) == len(REGEN_CONVS)


def test_bench_prompts_round_trip(tmp_path):
    bench = [REGEN_CONVS[0], REGEN_CONVS[1]]
    D.save_bench_prompts(tmp_path / "bench.jsonl", bench)
    back = D.load_bench_prompts(tmp_path / "bench.jsonl")
    assert back[0] == {"id": "two-turns", "messages": REGEN_CONVS[0]["messages"][:1], "reference": "Paris."}
    assert back[1]["messages"] == REGEN_CONVS[1]["messages"][:2] and back[1]["reference"] == "hi"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        D.load_bench_prompts(tmp_path / "nope.jsonl")


def test_interleave_keeps_each_lists_share_at_every_prefix():
    from eagle3lib.prepare.conversations import interleave

    train, val = [f"t{i}" for i in range(19)], ["v0"]
    mixed = interleave(train, val)
    assert sorted(mixed) == sorted(train + val) and 9 <= mixed.index("v0") <= 10
    assert [x for x in mixed if x.startswith("t")] == train
    assert interleave([], [1, 2]) == [1, 2]


def test_records_of_a_file_cut_mid_record_are_the_whole_ones_before_the_cut(tmp_path):
    """As the embedded ShareGPT file ends: the benchmarks' cuts take its records through iter_records."""
    from eagle3lib.prepare.sources import iter_records

    records = [{"id": str(i), "conversations": [{"from": "human", "value": "x" * i}]} for i in range(5)]
    whole = json.dumps(records, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(whole[: whole.index('"id": "4"') + 4])
    assert list(iter_records(cut)) == records[:4]
    lines = tmp_path / "cut.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records)[:-9])
    assert list(iter_records(lines)) == records[:4]
