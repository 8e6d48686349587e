"""Depth sweeps against a no-speculation baseline (docs/design.md §5).

Configurations: the baseline (no speculation), then each depth in bench.depths in order, or the cost model's
plan (speedup/plan.py), then the depth schedule those measurements imply (speedup/schedule.py). A depth is a
launch flag, so each configuration gets its own server (speedup/configuration.py); inside one server every
concurrency level is measured with the engine's statistics diffed around it (speedup/measurement.py), then the
serving load runs (speedup/load.py). One warm-up request precedes the measurements. A `Sweep` holds what the
configurations measured so far.

Prompts: the prepare stage's held-out bench split up to its first reply, rendered with the target's
chat template and sent as token ids (every engine sees the same tokens); greedy, ignore_eos,
fixed max_tokens. Losslessness: the share of prompts whose output tokens equal the baseline's at the
same concurrency (in bf16 the kernels of a batch of 1 and of a verify step round differently, so
run with bench.dtype float32 to check it token for token; docs/design.md §3).
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from eagle3lib import engines
from eagle3lib.engines.schedule import varying
from eagle3lib.speedup import cost, load, measurement, plan, prompt_sets, sampling, sizing
from eagle3lib.speedup import schedule as depth_schedule
from eagle3lib.speedup.configuration import compare_outputs, run_config
from eagle3lib.speedup.load import LoadSweep
from eagle3lib.speedup.recommend import figure_text

# ------------------------------------------------------------------------------ inputs ----


def prompt_ids(tokenizer, bench: list[dict], n: int) -> list[dict]:
    """The held-out set alone (bench.prompts [held_out]): its first n prompts as prompt_sets.build_prompts
    gives them."""
    out = prompt_sets.build_prompts(prompt_sets.renderer(tokenizer), [prompt_sets.HELD_OUT], n, bench)
    if not out:
        raise ValueError("Expected bench prompts, found none: data.bench_count is 0 or the bench split is empty.")
    return out


def predicted(eval_summary: dict, depth: int) -> dict:
    """Acceptance a chain of `depth` should get from the training eval's cond_acc (docs/design.md §5):
    per_pos[k] = joint_acc[k] = Π_{j≤k} cond_acc[j] (positions past the trained steps reuse the last
    cond_acc), accept_len = 1 + Σ per_pos."""
    cond = list(eval_summary["cond_acc"])
    return {**cost.acceptance(cond, depth), "extrapolated_from": len(cond)}


def preflight(engine_params, target_dir, draft_dir, depths) -> None:
    """Before any launch: SGLang's own ServerArgs resolution of the launch flags at each depth (EngineError
    lists the problems); vLLM's flags need no resolving ahead."""
    if engine_params.name == "sglang":
        for d in depths:
            engines.sglang.preflight(target_dir, draft_dir, d, engines.python_for(engine_params))


# ---------------------------------------------------------------------------- the sweep ----


class Sweep:
    """One sweep's measurements so far: every row (each with what the cost model predicted for it before it was
    measured, where it ran), the baseline's outputs per concurrency that each depth is compared with, the
    differences found, the samples drawn and their distribution checks. `measure` runs one configuration."""

    def __init__(
        self, engine_params, bench_params, target_dir, draft_dir, prompts: list[dict], log_dir,
        eval_summary: dict | None = None, progress=print, render=None, load: LoadSweep | None = None,
    ):  # fmt: skip
        self.engine_params, self.bench_params = engine_params, bench_params
        self.load = load  # the serving load each configuration also serves (speedup/load.py), or None
        self.load_rows: list[dict] = []
        self.schedule_rows: list[dict] = []  # the deployed depth schedule's rows (not among the fixed depths')
        self.schedule: dict | None = None  # deploy_schedule's record
        self.target_dir, self.draft_dir, self.log_dir = target_dir, draft_dir, log_dir
        self.prompts, self.eval_summary, self.render = prompts, eval_summary, render
        self.pending = [p for p in prompts if p["prompt_ids"] is None]
        if self.pending and render is None:
            raise ValueError(
                f"{self.pending[0]['id']} follows an earlier turn's answer: pass render to build its prompt"
            )
        self.say = progress or (lambda _line: None)
        self.bar = tqdm(total=1 + len(bench_params.depths), desc="sweep", unit="config", disable=progress is None)
        self.sampled = bench_params.temperature > 0
        self.generate = {"temperature": bench_params.temperature, "top_p": bench_params.top_p}
        self.rows: list[dict] = []
        self.baseline_outputs: dict[int, list[dict]] = {}  # concurrency -> [{id, token_ids, text}]
        self.differences: list[dict] = []
        self.draws: dict[int, dict] = {}  # depth (0: the baseline) -> draw_samples's result
        self.checks: list[dict] = []
        self.missing: list[dict] = []  # {config, why} of a configuration whose engine died or hung
        self.sizing: sizing.Fit | None = None  # the baseline's choice of prompts for the time left (size_to)

    def expect(self, configurations: int) -> None:
        """The progress bar's total: `configurations` in all, the baseline included."""
        self.bar.total = configurations

    def measure(
        self, depth, prompts: list[dict], prediction: dict | None = None, note: str = "",
        calibration: bool = False, concurrency: list[int] | None = None, size=None,
    ) -> list[dict]:  # fmt: skip
        """One configuration (depth None: the baseline, which goes first; a depth; or a DepthSchedule) on `prompts`
        at each concurrency (bench.concurrency unless given): its rows, also added to self.rows (a schedule's to
        self.schedule_rows). prediction: the cost model's {(depth, concurrency): predicted row} before this
        measurement; calibration: the model is fitted to it; size(server) -> the prompts (the baseline's size_to).
        With a load sweep, the server then serves each load point (self.load_rows) and each row gets its
        concurrency's closed-loop latency figures."""
        bench, name = self.bench_params, engines.config_name(depth, self.bench_params.dtype)
        varies = varying(depth)  # a schedule's depths had their draws checked one by one already
        self.say(f"[bench] {name}: starting {self.engine_params.name} ({len(prompts)} prompts{note})")
        self.bar.set_postfix_str(name)
        try:
            got, drawn, loaded = run_config(
                self.engine_params, self.target_dir, self.draft_dir, depth, prompts, bench.max_tokens,
                concurrency or bench.concurrency, self.log_dir, bench.dtype, self.generate,
                prepare=self._answer_first_turns if depth is None and self.pending else None,
                sample=self._sample_draws if self.sampled and bench.samples and not varies else None,
                size=size,
                load=self.load.measure if self.load is not None and concurrency is None else None,
            )  # fmt: skip
        except (engines.EngineError, KeyboardInterrupt) as e:
            why = str(e) if isinstance(e, engines.EngineError) else "interrupted (Ctrl-C) while it was measured"
            self.missing.append({"config": name, "why": why})
            raise
        self.load_rows += loaded
        for r in got:  # the closed-loop load point at the row's concurrency: its latency figures
            here = load.latency_at(loaded, r["config"], r["concurrency"])
            r.update({k: v for k, v in here.items() if k.endswith("_ms")})
        if drawn is not None:
            self._check_draws(depth, drawn)
        prompts = self.prompts if size is not None else prompts
        into = self.schedule_rows if got and got[0]["schedule"] else self.rows
        measured = [self._add_row(depth, r, prompts, prediction, calibration, into) for r in got]
        self.bar.update(1)
        return measured

    def deploy_schedule(self) -> None:
        """The depth per load the fixed configurations' rows imply (speedup/schedule.py, bench.slo_itl_p90_ms),
        deployed as the engine's own schedule and measured like them when it has several steps (one depth best
        at every load was measured already). An engine that refuses it is recorded with its words, not raised:
        the fixed configurations' results stand."""
        derived = depth_schedule.derive(self.rows, self.bench_params.slo_itl_p90_ms)
        chosen = derived["schedule"]
        self.schedule = {
            "schedule": chosen.as_json(),
            "text": chosen.text(),
            "steps": derived["steps"],
            "slo_itl_p90_ms": self.bench_params.slo_itl_p90_ms,
            "deployed": False,
            "refused": None,
        }
        self.say(f"[bench] depth schedule: {chosen.text()}")
        if chosen.is_fixed:
            self.schedule["why_not_deployed"] = "one configuration is the choice at every measured load: measured above"
            return
        try:
            self.measure(chosen, self.prompts, note=", the depth schedule")
            self.schedule["deployed"] = True
        except engines.EngineError as e:
            self.missing.pop()  # recorded here instead: the sweep goes on without it
            self.schedule["refused"] = str(e)
            self.say(f"[bench] the engine did not serve the depth schedule: {e}")

    def size_to(self, deadline: float, configurations: int):
        """The baseline's size(server): the prompts every configuration measures so that `configurations` of them
        end by `deadline` (time.time()), from what this server takes here (speedup/sizing.py); self.prompts becomes
        them and the line saying why is printed."""

        def size(server):
            bench = self.bench_params
            speeds = sizing.probe(server, self.prompts, bench.concurrency)
            left = deadline - time.time()
            loaded = 0.0 if self.load is None else self.load.seconds(speeds)
            self.sizing = sizing.fit(
                self.prompts, speeds, left, configurations, bench.max_tokens, bench.concurrency, loaded
            )
            self.prompts = self.sizing.prompts
            self.pending = [p for p in self.prompts if p["prompt_ids"] is None]
            self.say(f"[bench] {self.sizing.text()}")
            return self.prompts

        return size

    def _answer_first_turns(self, server) -> None:
        """The baseline's greedy answers to the turns that later turns follow (stopping at end of text)."""

        def answer(turns):
            bench = self.bench_params
            got, _ = measurement.run_requests(server, turns, bench.max_tokens, max(bench.concurrency), ignore_eos=False)
            return got

        prompt_sets.complete_turns(self.prompts, answer, self.render)

    def _sample_draws(self, server) -> dict:
        """The distribution check's samples of a few prompts (bench.sample_prompts) on this server."""
        bench = self.bench_params
        chosen = prompt_sets.take(self.prompts, bench.sample_prompts)
        return measurement.draw_samples(
            server, chosen, bench.samples, bench.sample_tokens, max(bench.concurrency), self.generate
        )

    def _check_draws(self, depth: int | None, drawn: dict) -> None:
        """Keep a configuration's draws; a depth's are checked against the baseline's."""
        self.draws[depth or 0] = drawn
        if depth is not None:
            check = sampling.distribution_check(self.draws[0], drawn, alpha=self.bench_params.sample_alpha)
            self.checks.append({"depth": depth, **check})
            self.say(
                f"[bench]   distribution check: p = {check['p_value']:.3g} ({'passed' if check['passed'] else 'FAILED'})"
            )

    def _against_baseline(self, depth: int | None, row: dict, outputs: list[dict]) -> dict:
        """The baseline row of the row's concurrency (the row itself for the baseline, whose outputs are kept);
        a greedy depth's outputs are compared token for token with the baseline's (sampled ones in distribution)."""
        c = row["concurrency"]
        if depth is None:
            self.baseline_outputs[c] = outputs
            return row
        if not self.sampled:
            cmp = compare_outputs(outputs, self.baseline_outputs[c])
            row["lossless_frac"] = cmp["lossless_frac"]
            found = cmp["differences"]
            self.differences.extend(
                d | {"depth": row["depth"], "config": row["config"], "concurrency": c} for d in found
            )
        return next(x for x in self.rows if x["depth"] == 0 and x["concurrency"] == c)

    def _add_row(self, depth, r: dict, prompts: list[dict], prediction, calibration: bool, into: list) -> dict:
        """A measured row with its speedups, losslessness, predicted acceptance and efficiency, added to rows."""
        base = self._against_baseline(depth, r, r.pop("outputs"))
        r["prompts"] = len([p for p in prompts if p["set"] != prompt_sets.CONTEXT])
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        for name, f in r["sets"].items():
            f["speedup"] = f["tokens_per_s"] / base["sets"][name]["tokens_per_s"]
        r.setdefault("lossless_frac", None if self.sampled else 1.0)
        if depth is None:
            r.update(accept_len=None, per_pos=[], predicted_accept_len=None, predicted_per_pos=[])
        elif self.eval_summary is not None and r["depth"]:
            pred = predicted(self.eval_summary, r["depth"])
            r.update(predicted_accept_len=pred["accept_len"], predicted_per_pos=pred["per_pos"])
        if prediction is not None:
            r["predicted_speedup"] = prediction[(depth, r["concurrency"])]["speedup"]
            r["calibration"] = calibration
        # how much of the acceptance length the speed keeps: tokens/s / (acceptance length x baseline tokens/s)
        r["efficiency"] = r["speedup"] / r["accept_len"] if r.get("accept_len") else None
        into.append(r)
        self.say(
            f"[bench]   concurrency {r['concurrency']}: {r['tokens_per_s']:.1f} tokens/s, speedup "
            f"{r['speedup']:.2f}"
            + (f" (predicted {r['predicted_speedup']:.2f})" if r.get("predicted_speedup") else "")
            + f", acceptance {figure_text(r.get('accept_len'))}, lossless {figure_text(r['lossless_frac'])}"
        )
        return r

    def result(self, model: dict | None, started: float) -> dict:
        """benchmark()'s result (see there); model: choose_and_measure's record, or None; started: time.time()."""
        bench, outputs = self.bench_params, self.baseline_outputs
        agreement = None  # the baseline against itself across concurrency: batching's own rounding
        if len(outputs) > 1 and not self.sampled:
            cs = sorted(outputs)
            agreement = compare_outputs(outputs[cs[-1]], outputs[cs[0]])["lossless_frac"]
        return {
            "rows": self.rows,
            "differences": self.differences,
            "baseline_agreement_across_concurrency": agreement,
            "baseline_outputs": {str(c): outs for c, outs in outputs.items()},
            "prompt_list": [
                {k: p[k] for k in ("id", "set", "category", "turn")} | {"prompt_tokens": len(p["prompt_ids"])}
                for p in self.prompts
            ],  # fmt: skip
            "sampling": {**self.generate, "distribution_checks": self.checks} if self.sampled else None,
            "dtype": bench.dtype or "engine default",
            "restart_per_configuration": True,
            "lossless_reference": f"baseline (no speculation) at the same concurrency, dtype {bench.dtype or 'engine default (bf16 on CPU)'}",
            "cost_model": model,
            "seconds": round(time.time() - started, 1),
            "missing": self.missing,
            "sizing": self.sizing.as_dict() | {"text": self.sizing.text()} if self.sizing else None,
            "load": self.load_rows,
            "schedule": None if self.schedule is None else self.schedule | {"rows": self.schedule_rows},
        }


def benchmark(
    engine_params,
    bench_params,
    target_dir,
    draft_dir,
    prompts: list[dict],
    log_dir,
    eval_summary: dict | None = None,
    progress=print,
    measure_costs=None,
    render=None,
    keep=None,
    deadline: float | None = None,
    load: LoadSweep | None = None,
) -> dict:
    """The sweep: the baseline, then the depths worth measuring, at each concurrency (docs/design.md §5).

    With the training eval's acceptance (eval_summary) and measure_costs (a callable, run after the baseline
    server stops, returning the in-process (forward_ms, draft_ms) of bench.cost.forward_costs), the cost model
    (bench.plan.choose_and_measure) predicts every depth 1..bench.max_depth; the depth it picks at the lowest
    concurrency is measured first and calibrates it (bench.cost.calibrate), then the pick at each concurrency, the
    lowest one's neighbours and bench.depths follow, fastest predicted first. Depths predicted below
    bench.quick_below at every concurrency run bench.quick_prompts prompts. Without them, bench.depths in order.

    Returns {rows, differences, recommendation, cost_model, ...}; rows carry the acceptance, speed and speedup fields plus
    tpot_ms, drafts, efficiency, predicted_speedup, prompts, ready_s, log; baseline_outputs holds the
    no-speculation outputs per concurrency. progress: a callable for status lines (a tqdm.auto bar counts the
    configurations too), or None for quiet.

    prompts: prompt_sets.build_prompts's (each labelled by its set); a row holds every set's figures under
    `sets` and is itself over every set but the long-context one, which runs at the lowest concurrency only.
    A later turn is built (render: messages -> ids) from the baseline's answer to the turn before it. With
    bench.temperature > 0 the requests are sampled, losslessness is the distribution check (bench.sampling)
    of bench.samples draws per prompt against the baseline's, and outputs are not compared token for token.

    deadline (time.time(), the run's run.minutes): the baseline's server sizes the prompts that every configuration
    measures so that the sweep ends by then (speedup/sizing.py; `sizing` in the result says what and why).

    load (speedup/load.py): each configuration's server also serves these load points through the engine's own
    serving benchmark (`load` in the result, and each row's closed-loop latency figures). With bench.schedule,
    the depth per load the measurements imply is deployed as the engine's schedule and measured like the fixed
    configurations (`schedule` in the result, speedup/schedule.py).

    An engine that dies or hangs (EngineError) ends the sweep: keep(partial result), when given, gets the rows
    measured before it and `missing` ({config, why}) first, then the error goes on."""
    started = time.time()
    sweep = Sweep(
        engine_params, bench_params, target_dir, draft_dir, prompts, log_dir, eval_summary, progress, render, load
    )
    cost_model = bench_params.pick_depth and eval_summary is not None and measure_costs is not None
    configurations = plan.expected_configurations(bench_params, cost_model) + int(bench_params.schedule)
    try:
        sweep.measure(None, prompts, size=sweep.size_to(deadline, configurations) if deadline else None)
        model = None
        if cost_model:
            model = plan.choose_and_measure(sweep, bench_params, eval_summary, measure_costs)
        else:
            for depth in bench_params.depths:
                sweep.measure(depth, sweep.prompts)
        if bench_params.schedule:
            sweep.deploy_schedule()
    except (engines.EngineError, KeyboardInterrupt):
        if keep is not None:
            keep(sweep.result(None, started))
        raise
    finally:
        sweep.bar.close()
    return sweep.result(model, started)


def lowest_concurrency_baseline(swept: dict) -> list[dict]:
    """benchmark()'s no-speculation outputs at the lowest concurrency: what a replay of the same prompts,
    greedy and one at a time, must reproduce."""
    outputs = swept["baseline_outputs"]
    return outputs[min(outputs, key=int)]
