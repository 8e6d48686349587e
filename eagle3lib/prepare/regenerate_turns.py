"""A conversation's regeneration, turn by turn (regenerate.py's notes): its state, the prompt of its next assistant
turn, a reply taken in, the record written; and the Job both ways of regenerating (hf batches, engine windows) share."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eagle3lib.prepare.conversations import render
from eagle3lib.prepare.sizing import TokenBudget


def start(conv) -> dict:
    return {"conv": conv, "out": [], "pos": 0, "gen": 0, "turns": 0, "stop": None}


def next_prompt(tokenizer, st, max_prompt_tokens, over_budget=False) -> str | None:
    """The prompt for st's next assistant turn, moving st past that turn; None (and st["stop"] says why)
    when the conversation ends here."""
    msgs = st["conv"]["messages"]
    nxt = next((j for j in range(st["pos"], len(msgs)) if msgs[j]["role"] == "assistant"), None)
    if nxt is None:
        st["stop"] = "done"
        return None
    if over_budget:
        st["stop"] = "budget"
        return None
    prompt = render(tokenizer, st["out"] + msgs[st["pos"] : nxt], add_generation_prompt=True)
    if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) > max_prompt_tokens:
        st["stop"] = "prompt too long"
        return None
    st["out"] += msgs[st["pos"] : nxt]
    st["pos"] = nxt + 1
    return prompt


def take_reply(st, text: str, n: int, finished: bool) -> int:
    st["out"].append({"role": "assistant", "content": text})
    st["gen"] += n
    st["turns"] += 1
    if not finished:  # the target had not finished: later user turns no longer fit
        st["stop"] = "max_new_tokens"
    return n


def record(st) -> dict:
    if st["turns"] == 0:
        messages = st["conv"]["messages"]
    else:
        last = max(j for j, m in enumerate(st["out"]) if m["role"] == "assistant")
        messages = st["out"][: last + 1]
    return {
        "id": st["conv"]["id"],
        "messages": messages,
        "regenerated": st["turns"] > 0,
        "turns_regenerated": st["turns"],
        "generated_tokens": st["gen"],
        "stop": st["stop"],
    }


@dataclass
class Job:
    """What the two ways of regenerating share: the conversations in input order, the records already done
    (by id) and the function that appends new ones, the token budget and the generation limits."""

    tokenizer: Any
    conversations: list
    done: dict
    write: Callable
    budget: TokenBudget
    max_new_tokens: int
    max_prompt_tokens: int
    eos_ids: set
    progress: bool
