"""Kimi's tokenizer (Kimi-K2 and K2.5 ship `TikTokenTokenizer` as remote code) rebuilt on the tiktoken package.

What the model folder gives: `tiktoken.model` (base64 token, rank per line), `tokenizer_config.json` (the special
tokens in `added_tokens_decoder`, bos/eos/pad names) and the chat template (`chat_template.jinja`, or inline in the
config). What Kimi's code adds, from its published facts: the pre-tokenizer pattern below (a Han branch first, Han
taken out of the letter branches), 256 special ids after the base vocabulary (those not in the config named
`<|reserved_token_{id}|>`), the 400k-character and 25k-run chunking that keeps tiktoken from overflowing, and
`tools_ts_str`, the TypeScript-style tool declaration its template prefers to JSON (tool_declarations.py).

It offers the part of the Hugging Face tokenizer interface the workbook uses: `__call__` (with padding and
tensors), `encode`, `decode`, `apply_chat_template` through transformers' own Jinja renderer, the special
tokens, `save_pretrained`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_SPECIAL = 256
MAX_ENCODE_CHARS = 400_000  # tiktoken panics on longer strings
MAX_RUN_CHARS = 25_000  # ... and on longer runs of only whitespace or only non-whitespace
CLASS_NAME = "TikTokenTokenizer"


def is_tiktoken_folder(folder) -> bool:
    """Whether a model folder holds a tiktoken tokenizer of Kimi's kind (tiktoken.model, TikTokenTokenizer)."""
    folder = Path(folder)
    config = folder / "tokenizer_config.json"
    if not (folder / "tiktoken.model").is_file() or not config.is_file():
        return False
    return json.loads(config.read_text()).get("tokenizer_class") == CLASS_NAME


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _chunks(text: str):
    """Kimi's (and Llama 3's) split of a long text into pieces tiktoken encodes safely: 400k characters at most,
    each cut again inside runs of more than 25k whitespace or non-whitespace characters."""
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        piece, start, run, kind = text[i : i + MAX_ENCODE_CHARS], 0, 0, None
        for j, ch in enumerate(piece):
            space = ch.isspace()
            run = run + 1 if space == kind else 1
            kind = space
            if run > MAX_RUN_CHARS:
                yield piece[start:j]
                start, run = j, 1
        yield piece[start:]


class TikTokenTokenizer:
    """A Kimi tokenizer over a model folder (see the module docstring)."""

    is_fast = False  # no Rust `tokenizers` backend (and no offset mappings: the loss mask does not need them)

    def __init__(self, folder):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.folder = Path(folder)
        if not is_tiktoken_folder(self.folder):
            raise ValueError(
                f"Expected {self.folder} to hold tiktoken.model and a tokenizer_config.json with tokenizer_class "
                f"{CLASS_NAME!r} (Kimi's tokenizer), found neither or another class."
            )
        self.config = json.loads((self.folder / "tokenizer_config.json").read_text())
        ranks = load_tiktoken_bpe(str(self.folder / "tiktoken.model"))
        self.num_base = len(ranks)
        added = self.config.get("added_tokens_decoder", {})
        named = {int(i): _token_text(v) for i, v in added.items()}
        ids = range(self.num_base, self.num_base + NUM_SPECIAL)
        outside = sorted(i for i in named if i not in ids)
        if outside:
            raise ValueError(
                f"Expected the added tokens of {self.folder / 'tokenizer_config.json'} in ids {ids.start}-"
                f"{ids.stop - 1} (after the {self.num_base} tokens of tiktoken.model), found {outside[:5]}: "
                "this tiktoken.model does not belong to this config."
            )
        self.special_ids = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
        # HF's skip_special_tokens keeps the added tokens marked special: false (Kimi's tool-call markers)
        kept = {int(i) for i, v in added.items() if isinstance(v, dict) and v.get("special") is False}
        self._skipped = set(ids) - kept
        self._encoding = tiktoken.Encoding(
            name=self.folder.name or "kimi", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=self.special_ids
        )
        template = self.folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else self.config.get("chat_template")
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            setattr(self, name, _token_text(self.config.get(name)))
        self.padding_side = self.config.get("padding_side", "left")

    # ---------------------------------------------------------------------------- ids ----

    def __len__(self) -> int:
        return self.num_base + NUM_SPECIAL

    @property
    def vocab_size(self) -> int:
        return len(self)

    def convert_tokens_to_ids(self, token):
        if isinstance(token, list):
            return [self.convert_tokens_to_ids(t) for t in token]
        if token in self.special_ids:
            return self.special_ids[token]
        return self._encoding.encode_single_token(token.encode())

    def __getattr__(self, name):
        # bos_token_id, eos_token_id, pad_token_id, unk_token_id from the names
        if name.endswith("_token_id") and name[: -len("_id")] in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = getattr(self, name[: -len("_id")])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of text; special-token strings in it become their ids (as Kimi's tokenizer does)."""
        out = []
        for piece in _chunks(text):
            out += self._encoding.encode(piece, allowed_special="all", disallowed_special=())
        return out

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skipped]
        return self._encoding.decode(ids)

    def __call__(
        self,
        text,
        add_special_tokens: bool = False,
        padding: bool = False,
        return_tensors: str | None = None,
        **_,
    ):
        """HF-style: {input_ids, attention_mask} of one text or a batch, padded (on
        padding_side) when asked, as tensors with return_tensors="pt"."""
        from transformers import BatchEncoding

        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t) for t in texts]
        enc = {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}
        if padding or return_tensors:
            width = max(len(x) for x in ids)
            pad = self.pad_token_id if self.pad_token is not None else self.eos_token_id
            for k, fill in (("input_ids", pad), ("attention_mask", 0)):
                enc[k] = [self._pad(x, width, fill) for x in enc[k]]
        if isinstance(text, str):
            enc = {k: v[0] for k, v in enc.items()}
        return BatchEncoding(enc, tensor_type=return_tensors)

    def _pad(self, row: list, width: int, fill) -> list:
        pad = [fill] * (width - len(row))
        return pad + row if self.padding_side == "left" else row + pad

    # ---------------------------------------------------------------------- template ----

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs,
    ):
        """The conversation through the model's chat template (transformers' Jinja renderer, the special tokens
        in scope); with tools, `tools_ts_str` is their TypeScript-style declaration, as Kimi's tokenizer passes.
        Template switches (e.g. `thinking=False`) pass through."""
        from transformers.utils.chat_template_utils import render_jinja_template

        from eagle3lib.target.tool_declarations import typescript_declaration

        if not self.chat_template:
            raise ValueError(f"Expected a chat template in {self.folder} (chat_template.jinja), found none.")
        if tools:
            kwargs.setdefault("tools_ts_str", typescript_declaration(tools))
        specials = {k: getattr(self, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        rendered = render_jinja_template(
            [conversation],
            tools=tools,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **specials,
            **kwargs,
        )
        text = (rendered[0] if isinstance(rendered, tuple) else rendered)[0]
        if not tokenize:
            return text
        ids = self.encode(text)
        return self(text) if return_dict else ids

    def save_pretrained(self, out_dir) -> Path:
        """The folder's tokenizer files copied to out_dir (what load_tokenizer reads back)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
            if (self.folder / name).is_file():
                shutil.copyfile(self.folder / name, out / name)
        return out
