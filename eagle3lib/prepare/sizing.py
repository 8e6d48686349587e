"""The regeneration sized to its minutes here (data.regenerate.max_minutes): the token budget cut to what
the rate measured over this run's first batch or window of conversations fits, decided once and recorded in the
regenerated file so that a resume keeps it (prepare/regenerate.py writes and reads it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenBudget:
    """The budget each conversation (engines) or batch (hf) is started against: `asked` (data.regenerate.budget_tokens)
    and, with max_minutes, from the index after the first window or batch of this run on, the budget its rate fits.

    decide() runs once: at r tokens/s, the budget is r * seconds less the tokens of one window or batch, the tail
    still in flight when it runs out (they start only while under it, and finish after). The budget and the index
    it starts at are recorded in every later line of the file, so a resume starts each conversation against the
    budget the uninterrupted run did, and writes the same file."""

    asked: int
    max_minutes: float | None
    sized: int | None = None
    from_index: int | None = None  # the first conversation (engines) or batch (hf) started against `sized`
    tokens_per_s: float | None = None
    probe: dict | None = None

    @classmethod
    def from_records(cls, asked: int, max_minutes: float | None, records) -> TokenBudget:
        """The budget, with the cut an earlier run recorded in `records` (the file's lines) if any."""
        recorded = next((r["sized_budget"] for r in records if "sized_budget" in r), None)
        if max_minutes is None or recorded is None:
            return cls(asked, max_minutes)
        return cls(asked, max_minutes, recorded["tokens"], recorded["from"])

    @property
    def pending(self) -> bool:
        return self.max_minutes is not None and self.sized is None

    def at(self, index: int) -> int:
        """The budget conversation or batch `index` starts against."""
        return self.asked if self.sized is None or index < self.from_index else self.sized

    def decide(self, from_index: int, tokens: int, seconds: float, conversations: int, tail_tokens: float) -> None:
        """The cut, from this run's first `conversations`: `tokens` generated in `seconds`, tail_tokens what one
        window or batch of them generated; it applies from `from_index` on."""
        self.tokens_per_s = tokens / max(seconds, 1e-9)
        fits = self.tokens_per_s * self.max_minutes * 60 - tail_tokens
        self.sized, self.from_index = max(0, min(self.asked, int(fits))), from_index
        self.probe = {"conversations": conversations, "tokens": tokens, "seconds": round(seconds, 2)}

    def record(self) -> dict:
        """What every line written after the decision carries."""
        return {} if self.sized is None else {"sized_budget": {"tokens": self.sized, "from": self.from_index}}

    def as_dict(self) -> dict | None:
        """The stats' record of the sizing (None without max_minutes)."""
        if self.max_minutes is None:
            return None
        out = {"max_minutes": self.max_minutes, "asked_tokens": self.asked, "sized_tokens": self.sized}
        if self.tokens_per_s is not None:
            out |= {"tokens_per_s": round(self.tokens_per_s, 1), "probe": self.probe}
        return out | {"text": self.text()}

    def text(self) -> str:
        """The console's and the report's line: what the regeneration was sized to, and why."""
        asked, minutes = f"{self.asked:,}", f"{self.max_minutes:g} min (data.regenerate.max_minutes)"
        if self.sized is None:
            return f"regeneration not sized: it ended before its first window of conversations ({asked} tokens asked)"
        if self.tokens_per_s is None:
            return f"regeneration budget {self.sized:,} of {asked} tokens, as sized by the run it resumed"
        rate = (
            f"{self.tokens_per_s:,.1f} tokens/s over the first {self.probe['conversations']} conversations, {minutes}"
        )
        if self.sized < self.asked:
            return f"regeneration sized to {self.sized:,} of {asked} tokens: {rate}"
        return f"regeneration not cut: all {asked} tokens fit ({rate})"
