"""train.online_placement: thread. The capture runs in a thread of each training process, on its device, through
the bounded queue of batches.in_background: on one device the capture and the trainer take turns. With
extract.backend sglang_inprocess the capture is SGLang's model runner, so the stage runs in SGLang's interpreter,
one trainer process (its tensor-parallel ranks on the engine's other GPUs)."""

from __future__ import annotations

from eagle3lib import run_folder
from eagle3lib.train import TrainingError
from eagle3lib.train.runtime.batches import micro_batches, pack_val_rows
from eagle3lib.train.sources import online
from eagle3lib.train.sources.base import SUMMARY, TRAIN_ENTRY, OnlinePlacement, StageProcess, StageRun

ENGINE_LOG = "sglang-online.log"  # under 02_train: the stage's output when it runs in SGLang's interpreter


class CapturedSource:
    """The states captured in this process (online.capture_setup's data) as a BatchSource. owned: the capture was
    loaded for this source (closed with it), not handed in by a caller who keeps it open."""

    def __init__(self, train: online.OnlineData, val: online.OnlineData, contract: dict, owned: bool):
        self.train, self.val, self.contract, self.owned = train, val, contract, owned

    def val_rows(self, train_params) -> list[dict]:
        return pack_val_rows(self.val.val_sequences(), train_params)

    def stream(self, train_params, state: dict):
        return micro_batches(
            self.train.train_sequences,
            train_params,
            state["epoch"],
            state["micro_in_epoch"],
            state.get("sequence_in_epoch"),  # absent from checkpoints of older versions: packed again up to the index
            depth=train_params.online_queue_batches,
        )

    def summary(self) -> dict:
        return {"online": online.online_stats(self.train)}

    def close(self) -> None:
        if self.owned:  # an engine this stage started (its tensor-parallel ranks) stops
            self.train.close()


class InThread(OnlinePlacement):
    name = "thread"

    def open(self, proc: StageProcess, tokens: dict) -> CapturedSource:
        stage_dir = run_folder.stage_dir(proc.run_dir, "02_train")
        train, val, contract = online.capture_setup(proc.p, tokens["train"], tokens["val"], stage_dir, proc.handed)
        return CapturedSource(train, val, contract, owned=proc.handed is None)

    def device_split(self, p) -> tuple[str, bool]:
        n = p.train.nproc_per_node
        return f"the capture runs in a thread of each of the {n} training process(es), on their device", True


class InEngineThread(InThread):
    """The thread placement with SGLang's model runner as the capture (extract.backend sglang_inprocess)."""

    name = "thread (sglang_inprocess)"

    def launch(self, run: StageRun) -> dict:
        """The stage in SGLang's interpreter (engine.python, or .venv-sglang), one trainer process whose thread drives
        SGLang's model runner. Its output is shown as it comes and kept in 02_train/sglang-online.log; a failure
        raises with the log's last lines."""
        from eagle3lib.engines.interpreter import module_env, run_module
        from eagle3lib.extract.backends import engine_settings

        engine = engine_settings(run.p, "sglang")
        if engine["python"] is None:
            raise FileNotFoundError(
                "train.source: online with extract.backend sglang_inprocess trains in SGLang's interpreter and none "
                "was found: set engine.name: sglang and engine.python, or build .venv-sglang (make sglang-env)"
            )
        out_dir = run_folder.stage_dir(run.run_dir, "02_train")
        env = module_env(engine["env"])
        env.pop("WORLD_SIZE", None)  # one trainer: SGLang's ranks make their own group
        run_module(
            engine["python"],
            TRAIN_ENTRY,
            run.command_args(),
            out_dir / ENGINE_LOG,
            env=env,
            finished=(out_dir / SUMMARY).is_file,
            failure=lambda code: (
                f"online training in SGLang's interpreter exited {code} (checkpoints already written are kept and "
                "resume)"
            ),
            error=TrainingError,
        )
        return run.summary()

    def device_split(self, p) -> tuple[str, bool]:
        split = (
            "SGLang's model runner captures in a thread of the one training process (run in SGLang's interpreter), "
            "the trainer on the engine's first GPU"
        )
        return split, True
