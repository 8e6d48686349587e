"""The cost model's part of the sweep (docs/design.md §5): which depths to measure, in what order and on how many
prompts, and the loop that measures them, refitting the model after each.

The plan is pure (predictions and bench params in, depths out): `depths_to_measure` orders the depths once the
first pick has calibrated the model, `how_to_measure` decides each one's prompts and concurrency from the model as
refitted on the depths measured before it. `choose_and_measure` runs them through a sweep's `measure`.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3lib.speedup import cost, prompt_sets


@dataclass(frozen=True)
class Plan:
    depths: list[int]  # to measure, in order: the picks and neighbours fastest predicted first, then the asked depths
    picks: dict[int, int]  # concurrency -> the depth predicted fastest there
    asked: list[int]  # bench.depths not measured already and neither a pick nor a neighbour
    predicted_only: list[int]  # asked depths the calibrated model answers alone (bench.asked_depths: predict)


@dataclass(frozen=True)
class Measurement:
    depth: int
    predicted_speedup: float  # the best over concurrency
    quick: bool  # on a few prompts
    prompts: int | None  # how many prompts when quick; None: every prompt
    concurrency: list[int] | None  # None: every level of bench.concurrency


def picks(prediction: list[dict], concurrency) -> dict[int, int]:
    """{concurrency: the depth predicted fastest there} from cost.predict's rows."""
    return {c: cost.best_depth(prediction, c)["depth"] for c in concurrency}


def keyed(prediction: list[dict]) -> dict[tuple[int, int], dict]:
    """cost.predict's rows by (depth, concurrency): what a sweep's measure sets beside each measured row."""
    return {(r["depth"], r["concurrency"]): r for r in prediction}


def depths_to_measure(prediction: list[dict], bench, measured) -> Plan:
    """The depths still to measure from cost.predict's rows over every depth and concurrency: the pick at each
    concurrency and, with bench.neighbours, the lowest concurrency's pick ± 1, fastest predicted first; then
    bench.depths (asked), unless bench.asked_depths leaves them to the model. Depths in `measured` are skipped."""
    conc = list(bench.concurrency)
    by_key = keyed(prediction)
    chosen = picks(prediction, conc)
    low = chosen[min(conc)]
    neighbours = (low - 1, low + 1) if bench.neighbours else ()
    order = sorted(
        {*chosen.values(), *(d for d in neighbours if 1 <= d <= bench.max_depth)} - set(measured),
        key=lambda d: -max(by_key[(d, c)]["speedup"] for c in conc),
    )
    asked = [d for d in bench.depths if d not in order and d not in measured]
    predicted_only = asked if bench.asked_depths == "predict" else []
    return Plan(order + [d for d in asked if d not in predicted_only], chosen, asked, predicted_only)


def expected_configurations(bench, cost_model: bool) -> int:
    """How many configurations a sweep measures at most, the baseline included, before it knows its picks: with the
    cost model the baseline, the first pick, the calibrated pick at each concurrency (the lowest's can move off the
    first pick: depth 3, then 4 and 2 on a 2-core CPU without native bf16), the neighbours and the asked depths when
    they are measured (each quick or full; picks that coincide make it fewer); without it the baseline and
    bench.depths."""
    if not cost_model:
        return 1 + len(bench.depths)
    asked = len(bench.depths) if bench.asked_depths != "predict" else 0
    return 2 + len(set(bench.concurrency)) + (2 if bench.neighbours else 0) + asked


def how_to_measure(depth: int, prediction: list[dict], plan: Plan, bench) -> Measurement:
    """How one planned depth is measured, given its predicted rows (one per concurrency): quick (a few prompts)
    when predicted below bench.quick_below at every concurrency, unless it is a pick (the recommendation rests on
    those, so they run every prompt); an asked depth under bench.asked_depths quick runs bench.quick_prompts
    prompts at the lowest concurrency (the user's question, answered cheaply). Other quick depths keep at least
    one prompt per request in flight at the highest concurrency."""
    best = max(r["speedup"] for r in prediction if r["depth"] == depth)
    asked_quick = bench.asked_depths == "quick" and depth in plan.asked
    quick = asked_quick or (best < bench.quick_below and depth not in plan.picks.values())
    few = bench.quick_prompts if asked_quick else max(bench.quick_prompts, max(bench.concurrency))
    return Measurement(depth, best, quick, few if quick else None, [min(bench.concurrency)] if asked_quick else None)


def choose_and_measure(sweep, bench, eval_summary: dict, measure_costs) -> dict:
    """The cost model's part of the sweep, after the baseline (see sweep.benchmark): costs from the baseline rows
    and measure_costs(), the first pick measured and used to calibrate, then the plan, each depth predicted by
    the model refitted on every depth measured before it. sweep: its `rows` (the baseline's), `prompts`,
    `measure(depth, prompts, prediction, note, calibration, concurrency)`, `say(line)` and `expect(configurations)`.

    Returns the model's record: its costs, the predictions before and after calibration and at the end, the
    picks, and the plan."""
    conc = list(bench.concurrency)
    depths = list(range(1, bench.max_depth + 1))
    cond = list(eval_summary["cond_acc"])
    decode, share = cost.decode_costs([r for r in sweep.rows if r["depth"] == 0])
    forward, draft = measure_costs()
    costs = cost.Costs(decode, forward, draft, share)
    before = cost.predict(costs, cond, depths, conc)
    first = cost.best_depth(before, min(conc))["depth"]
    sweep.say(f"[bench] cost model: depth {first} predicted fastest at concurrency {min(conc)}; measuring it first")
    sweep.expect(2 + len(bench.depths))  # the baseline, the first pick, then bench.depths until the plan is known
    measured = sweep.measure(first, sweep.prompts, keyed(before), ", calibrates", True)
    costs = cost.calibrate(costs, cond, measured)
    after = cost.predict(costs, cond, depths, conc)
    todo = depths_to_measure(after, bench, [first])
    sweep.expect(2 + len(todo.depths))
    quick = []
    for d in todo.depths:
        ahead = cost.predict(costs, cond, [d], conc)  # the model refitted on the depths measured before d
        how = how_to_measure(d, ahead, todo, bench)
        if how.quick:
            quick.append(d)
        used = prompt_sets.take(sweep.prompts, how.prompts) if how.quick else sweep.prompts
        note = f", predicted {how.predicted_speedup:.2f}x" + (": quick" if how.quick else "")
        measured += sweep.measure(d, used, keyed(ahead), note, concurrency=how.concurrency)
        costs = cost.calibrate(costs, cond, measured)
    if todo.predicted_only:
        sweep.say(
            f"[bench] depths {todo.predicted_only} predicted by the calibrated cost model, not measured (bench.asked_depths)"
        )
    final = cost.predict(costs, cond, depths, conc)
    return {
        "costs": costs.as_dict(),
        "predicted_before_calibration": before,
        "predicted_after_first": after,
        "predicted": final,
        "picks": {str(c): d for c, d in todo.picks.items()},
        "final_picks": {str(c): d for c, d in picks(final, conc).items()},
        "calibrated_on": first,
        "plan": [first, *todo.depths],
        "quick": quick,
        "predicted_only": todo.predicted_only,
    }
