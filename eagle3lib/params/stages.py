"""What each stage reads of the params (STAGE_SECTIONS), and the view of the params that holds a stage to it
(stage_view)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from eagle3lib.params.model import Params
from eagle3lib.params.schema import Section

# A stage's hash (workbook/pipeline.py stage_hash) covers the sections it reads, so a change elsewhere leaves it
# current, and its result records the auto dtypes among them (workbook/stage.py Stage.save). Its process gets the
# params through stage_view, in which a section it does not read raises: the list is checked by every run, not
# kept by hand. A section read under a choice of the params only is listed with that choice; the choice itself
# lies in a section the stage reads then, so the hash covers it too. A stage not listed reads every section.
#
# run is readable by every stage and hashed by none but run.seed (which every hash takes): name and output_root
# say where the run folder is (another folder holds other results), cache_dir where converted targets are kept
# (the same files wherever it is), hide_code how the reports look (a skipped stage's report is re-rendered).
BOOKKEEPING = "run"


class Read(NamedTuple):
    """When a stage reads a section: `when` in words (for the errors), `applies` on the run's params."""

    when: str
    applies: Callable[[Params], bool]


ALWAYS = Read("always", lambda p: True)

STAGE_SECTIONS: dict[str, dict[str, Read]] = {
    "00_prepare": {
        "target": ALWAYS,
        "data": ALWAYS,
        # prepare/notebook.py regenerate_plan_text (engine.name) and regenerate_splits (the engine regenerates)
        "engine": Read(
            "data.regenerate has a budget_tokens and backend engine",
            lambda p: p.data.regenerate.budget_tokens > 0 and p.data.regenerate.backend == "engine",
        ),
    },
    "01_extract": {
        "target": ALWAYS,
        "extract": ALWAYS,
        # extract/backends.py engine_settings: the engine's python, extra_args, env, host, port, start_timeout_s
        "engine": Read(
            "extract.backend is an engine (vllm, sglang, sglang_inprocess)", lambda p: p.extract.backend != "hf"
        ),
        # extract/backends.py make_capture: vLLM's --max-model-len from data.max_seq_len
        "data": Read("extract.backend is vllm", lambda p: p.extract.backend == "vllm"),
    },
    "02_train": {
        "target": ALWAYS,
        "train": ALWAYS,
        # train/sources/online.py load_states, capture_setup (backend, batch_tokens, shard_max_tokens,
        # store_dtype) and train/sources/__init__.py online_placement (backend)
        "extract": Read("train.source is online", lambda p: p.train.source == "online"),
        # train/sources/thread.py InEngineThread.launch, train/sources/process.py InEngineProcess and
        # train/sources/online.py load_states: extract/backends.py engine_settings for SGLang's interpreter and flags
        "engine": Read(
            "train.source is online with extract.backend sglang_inprocess",
            lambda p: p.train.source == "online" and p.extract.backend == "sglang_inprocess",
        ),
    },
    "03_convert": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},  # bench.depths: the exports' depth
    "04_deploy": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},
    "05_benchmark": {"target": ALWAYS, "engine": ALWAYS, "bench": ALWAYS},
}


def stage_sections(stage: str, p: Params) -> list[str]:
    """The sections `stage` reads with these params (not run: see BOOKKEEPING), in STAGE_SECTIONS' order; every
    section, run included, for a stage not listed."""
    if stage not in STAGE_SECTIONS:
        return Params.section_names()
    return [name for name, read in STAGE_SECTIONS[stage].items() if read.applies(p)]


class UnreadSectionError(Exception):
    """A stage read a params section its hash does not cover (STAGE_SECTIONS). Not an AttributeError, so that
    hasattr and getattr with a default do not hide the read."""


class UnreadSection:
    """A section in a stage's view of the params (stage_view) that the stage does not read: passing it around is
    fine, any attribute read or write raises UnreadSectionError."""

    __slots__ = ("_stage", "_name", "_reads", "_section")

    def __init__(self, stage: str, name: str, reads: list[str], section: Section):
        for slot, value in zip(self.__slots__, (stage, name, reads, section), strict=True):
            object.__setattr__(self, slot, value)

    def _refuse(self, attr: str, did: str = "read") -> UnreadSectionError:
        stage, name = self._stage, self._name
        read = STAGE_SECTIONS[stage].get(name)
        if read:
            why, fix = f"reads {name} only when {read.when}, not with these params", "widen its choice in"
        else:
            why, fix = f"does not read the {name} section", f"add {name!r}, with the choice under which it is read, to"
        return UnreadSectionError(
            f"{stage} {did} params {name}.{attr}, and {stage} {why}; it reads {', '.join(self._reads)} and run. Its "
            f"hash does not cover {name}, so a changed {name} would leave a stale {stage} result that a rerun skips. "
            f"If {stage} needs {name}, {fix} STAGE_SECTIONS[{stage!r}] in eagle3lib/params/stages.py; else take the value "
            "from an earlier stage's result"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy, pickle and the like probe for protocol methods: not a read
            raise AttributeError(attr)
        raise self._refuse(attr)

    def __setattr__(self, attr: str, value) -> None:
        raise self._refuse(attr, "set")

    def __reduce__(self):  # copies and pickles are made through __init__, as __setattr__ refuses
        return UnreadSection, (self._stage, self._name, self._reads, self._section)

    def __repr__(self) -> str:
        return f"<params.{self._name}: not read by {self._stage}>"


def stage_view(p: Params, stage: str) -> Params:
    """The params as `stage`'s processes see them: the sections it reads with these params (stage_sections), run,
    and the bookkeeping (file, overrides, dtype_choices) as they are; every other section an UnreadSection. A stage
    not in STAGE_SECTIONS reads every section and gets p. The stage notebook's (workbook/stage.py open_stage), and
    each process it starts that loads the params again: `stage_view(load_params(file, overrides), "02_train")`."""
    if stage not in STAGE_SECTIONS:
        return p
    reads = stage_sections(stage, p)
    unread = {
        name: UnreadSection(stage, name, reads, getattr(p, name))
        for name in Params.section_names()
        if name != BOOKKEEPING and name not in reads
    }
    return p.model_copy(update=unread)  # model_copy does not validate: the UnreadSections stay
