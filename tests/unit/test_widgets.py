"""widgets.py: each widget builds, its control changes what it shows, and it has a static rendering."""

import json
import re

import ipywidgets
import pytest
from sweep_rows import ROWS

from eagle3lib.speedup.replay import TARGET
from eagle3lib.train.metrics import acceptance_summary
from eagle3lib.workbook import report, widgets


def evals():
    return [
        {"step": 0, "eval": acceptance_summary([0.011, 0.0, 0.0], [0.011, 0.0, 0.0], max_depth=16, positions=50)},
        {"step": 100, "eval": acceptance_summary([0.612, 0.41, 0.3], [0.612, 0.5, 0.4], max_depth=16, positions=50)},
        {"step": 200, "eval": acceptance_summary([0.733, 0.52, 0.4], [0.733, 0.6, 0.5], max_depth=16, positions=50)},
    ]


def test_training_evals_read_the_log(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(
        "".join(
            json.dumps(x) + "\n"
            for x in [
                {"step": 1, "loss": 3.0},
                {"step": 100, "eval": evals()[1]["eval"]},
                {"step": 2, "loss": 2.0},
                {"step": 200, "eval": evals()[2]["eval"]},
            ]
        )
    )
    got = widgets.training_evals(log, initial=evals()[0]["eval"])
    assert [e["step"] for e in got] == [0, 100, 200] and got[2]["eval"]["step_acc"][0] == 0.733


def test_accuracy_explorer_follows_the_slider():
    w = widgets.accuracy_explorer(evals())
    slider, view = w.children
    assert isinstance(slider, ipywidgets.SelectionSlider) and slider.label == "step 200"
    assert "0.733" in view.value and "data:image/png;base64," in view.value
    assert "extrapolated" in view.value  # depths past the 3 trained steps
    slider.value = 0
    assert slider.label == "before training" and "0.011" in view.value and "0.733" not in view.value
    static = widgets.evals_table_html(evals())
    assert all(s in static for s in ("0.011", "0.612", "0.733", "est. len @5"))


def test_one_validation_per_position_and_per_depth():
    ev = evals()[2]["eval"]  # trained 3 steps ahead, estimated to depth 16
    rows = widgets.per_position_rows(ev)
    assert [r["position"] for r in rows] == [1, 2, 3] and rows[1]["cond_acc"] == 0.6
    assert rows[2]["joint_acc"] == pytest.approx(0.733 * 0.6 * 0.5)
    at = widgets.est_accept_len_at(ev)
    assert list(at) == ["depth 1", "depth 3"] + [f"depth {d} (extrapolated)" for d in (5, 7, 10, 16)]
    assert at["depth 1"] == pytest.approx(1.733) and at["depth 3"] == ev["est_accept_len"]["3"]
    assert widgets.est_accept_len_at(ev, depths=(2, 40)) == {"depth 2": ev["est_accept_len"]["2"]}


def prov():
    """A provenance record as replay_prompts writes it: two prompts, depths 2 and 5."""

    def replay(ids, source, accept_len):
        return {
            "token_ids": ids,
            "pieces": [f"t{i}" + ("\n" if i == 2 else " ") for i in ids],
            "source": source,
            "rounds": source.count(TARGET),
            "accepted": len(ids) - source.count(TARGET),
            "accept_len": accept_len,
            "per_pos": [],
            "equals_baseline": True,
        }

    base = {"token_ids": [1, 2, 3, 4, 5], "pieces": ["t1 ", "t2\n", "t3 ", "t4 ", "t5 "]}
    return {
        "depths": [2, 5],
        "max_tokens": 5,
        "target_dtype": "float32",
        "summary": {},
        "prompts": [
            {
                "id": "a",
                "prompt": "first <question>",
                "baseline": base,
                "replays": {
                    "2": replay([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], 1.5),
                    "5": replay([1, 2, 3, 4, 5], [0, 1, 2, 3, 0], 2.0),
                },
            },
            {
                "id": "b",
                "prompt": "second question",
                "baseline": dict(base, token_ids=[1, 2, 9, 9, 9]),
                "replays": {
                    "2": replay([1, 2, 3, 4, 5], [0, 0, 0, 0, 0], 1.0),
                    "5": replay([1, 2, 3, 4, 5], [0, 0, 0, 0, 0], 1.0),
                },
            },
        ],
    }


def spans(page):
    return re.findall(r"<span class='e3-tok' style='background:(#\w+);[^']*' title='([^']*)'>([^<]*)</span>", page)


def test_provenance_explorer_colours_each_token_by_its_source():
    w = widgets.provenance_explorer(prov(), depth=5)
    (row, depths, view) = w.children
    prompt = row.children[0]
    assert depths.value == 5 and "first &lt;question&gt;" in view.value
    got = spans(view.value)
    assert [t for _, _, t in got] == ["t1 ", "t2&#8629;\n", "t3 ", "t4 ", "t5 "]
    assert [title for _, title, _ in got] == ["from the target (prefill or verification)"] + [
        f"draft token accepted at position {k}" for k in (1, 2, 3)
    ] + ["from the target (prefill or verification)"]
    colours = [c for c, _, _ in got]
    assert colours[0] == colours[4] == widgets.source_colour(TARGET, 5)[0] and len(set(colours[1:4])) == 3
    assert "acceptance length 2" in view.value and "identical to the replay" in view.value
    depths.value = 2
    assert "acceptance length 1.5" in view.value and len(re.findall(r"<span style='background", view.value)) == 3
    prompt.value = 1
    assert "second question" in view.value and "differs from the replay from token 2 on" in view.value
    assert {t for _, t, _ in spans(view.value)} == {"from the target (prefill or verification)"}


def test_the_report_shows_the_prompt_with_the_most_drafted_tokens():
    assert widgets.showcase_prompt(prov(), 5) == 0
    record = prov()
    record["prompts"][1]["replays"]["5"]["source"] = [0, 1, 2, 3, 4]
    assert widgets.showcase_prompt(record, 5) == 1
    w = widgets.provenance_explorer(record, 5, prompt_index=1)
    assert w.children[0].children[0].value == 1 and "second question" in w.children[2].value


def test_default_depth_is_the_recommended_one():
    assert widgets.default_depth(prov(), {"1": {"depth": 2}, "8": {"depth": 5}}) == 2
    assert widgets.default_depth(prov(), {"1": {"depth": 0}}) == 5  # baseline won: the deepest chain
    assert widgets.default_depth(prov(), None) == 5


def test_speed_explorer_shows_the_picked_concurrency():
    rec = {
        "1": {"config": "depth5", "tokens_per_s": 56.0, "speedup": 2.0},
        "8": {"config": "baseline", "tokens_per_s": 160.0, "speedup": 1.0},
    }
    w = widgets.speed_explorer(ROWS, rec)
    pick, view = w.children
    assert pick.value == 1 and "56" in view.value and "160" not in view.value and "<b>depth5</b>" in view.value
    pick.value = 8
    assert "160" in view.value and "56.0" not in view.value and "<b>baseline</b>" in view.value
    static = widgets.speed_static_html(ROWS, rec)
    assert "concurrency 1" in static and "concurrency 8" in static and static.count("<table") == 2


def test_show_bundles_the_widget_with_its_static_html():
    w = widgets.speed_explorer(ROWS)
    data = widgets.bundle(w, "<p>static</p>")
    assert data["text/html"] == "<p>static</p>"
    assert data[report.WIDGET_VIEW]["model_id"] == w.model_id


def test_widgets_refuse_empty_inputs():
    with pytest.raises(ValueError, match="at least one validation"):
        widgets.accuracy_explorer([])
    with pytest.raises(ValueError, match="benchmark rows"):
        widgets.speed_explorer([])
