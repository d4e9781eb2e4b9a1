from dataclasses import replace

import pytest

from commbench.fabric.budget import compute_time_us, expert_flops
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.specs import load_spec
from commbench.report.frame import results_frame
from commbench.report.pages.render import Section, html_page, markdown_page
from commbench.report.pages.tables import Table
from commbench.report.profiler.budget import BUDGET_TITLE, BUSIEST_COLUMN, moe_budget
from commbench.run.case import model_digest
from tests.report.rows import balanced_row, skewed_rows

# skewed_rows: pattern "toy", dispatch p50 100 us, combine p50 200 us: 300 us of all-to-all per layer.
TOY = ModelConfig("toy", hidden=4096, num_experts=16, topk=4, moe_intermediate=1024)
SELECTIONS = 1000
# 2 x 3 x 4096 x 1024 x 1000 FLOPs = 25.17 GFLOP: 50.3 us at 500 TFLOPs/GPU.
COMPUTE_US = 2 * 3 * 4096 * 1024 * SELECTIONS / 500e12 * 1e6


GPU_ROWS = {"backend": "nccl", "backend_name": "nccl"}  # a GPU fabric's times: the budget is judged


def _frame(time_us: float = 100.0, **extra):
    rows = [balanced_row(4, 1 << 20, 50.0), *skewed_rows(time_us, **{**GPU_ROWS, **extra})]
    return results_frame(rows, load_spec("hgx-h100"))


def _markdown(section: Section | None) -> str:
    """The section's body in summary.md (its blocks, blank-line separated)."""
    assert section is not None and section.title == BUDGET_TITLE
    return markdown_page(section.blocks).strip()


def _table_text(section: Section | None) -> str:
    """The section's table as stdout prints it."""
    assert section is not None and isinstance(section.blocks[0], Table)
    return section.blocks[0].text()


def test_moe_case_table_ratio_and_verdict():
    spec = load_spec("hgx-h100")
    text = _markdown(moe_budget(_frame(**{BUSIEST_COLUMN: SELECTIONS}), TOY, tflops=500, spec=spec))
    table, notes = text.split("\n\n")
    lines = table.splitlines()
    assert lines[0].startswith("| case") and "comm/compute fwd" in lines[0]
    first = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert first[0] == "toy skew hot:1:0.5 64 tok/rank" and first[1] == "1000"  # the layer's Case.label
    assert first[3] == "--tflops" and first[5] == "300.0" and first[6] == f"{COMPUTE_US:.1f}"
    assert first[7] == f"{300 / COMPUTE_US:.2f}" and first[8] == f"{2 * 300 / (3 * COMPUTE_US):.2f}"
    assert first[9] == "no / no"
    assert len(lines) == 2 + 3  # --tflops and the spec's dense BF16 / FP8 peaks
    assert notes.startswith("- toy at 500 TFLOPs/GPU") and "training cannot hide it" in notes
    assert "expert FLOPs (forward) = 2 x 3 x hidden x moe_intermediate x selections" in notes
    assert "DualPipe-style overlap" in notes


def test_hidden_when_the_all_to_all_is_short():
    fast = COMPUTE_US / 3 * 0.9  # dispatch t + combine 2t = 0.9 x the forward compute
    text = _markdown(moe_budget(_frame(fast, **{BUSIEST_COLUMN: SELECTIONS}), [TOY], tflops=500, spec=None))
    assert "yes / yes" in text and "training hides it" in text and "forward hides it" in text


def test_repeats_take_the_median_of_each_phase():
    rows = skewed_rows(100.0, repeat=0, **{BUSIEST_COLUMN: SELECTIONS})
    rows += skewed_rows(110.0, repeat=1, **{BUSIEST_COLUMN: SELECTIONS})
    rows += skewed_rows(500.0, repeat=2, **{BUSIEST_COLUMN: SELECTIONS})
    text = _table_text(moe_budget(results_frame(rows, load_spec("hgx-h100")), TOY, tflops=500))
    assert "330.0" in text.splitlines()[1]  # median 110 + median 220


def test_selection_mode_reads_the_received_rows_without_the_column():
    rows = skewed_rows(100.0, row_bytes=1000)
    for row in rows:
        row["send_mode"] = "selection"
    frame = results_frame(rows, load_spec("hgx-h100"))
    text = _table_text(moe_budget(frame, TOY, tflops=500))
    # The busiest rank received 1,240,000 bytes in dispatch = 1,240 selection rows of 1,000 bytes.
    assert text.splitlines()[1].split()[7] == "1240"  # after "toy skew hot:1:0.5 64 tok/rank send selection"
    assert f"{expert_flops(TOY, 1240) / 1e9:.1f}" in text.splitlines()[1]
    assert compute_time_us(expert_flops(TOY, 1240), 500) == pytest.approx(COMPUTE_US * 1.24)


def test_what_is_missing_is_said():
    text = _markdown(moe_budget(_frame(), TOY))  # token mode, no column
    assert f"not computed: the rows have no {BUSIEST_COLUMN} column" in text
    other = _markdown(moe_budget(_frame(**{BUSIEST_COLUMN: 10}), load_model("deepseek-v3")))
    assert "not computed: model toy not given" in other
    same_name = replace(TOY, hidden=TOY.hidden * 2)  # the rows' model digest tells it from the one measured
    rows = [{**row, "model_digest": model_digest(TOY)} for row in skewed_rows(**{BUSIEST_COLUMN: 10})]
    assert "not computed: model toy not given" in _markdown(moe_budget(results_frame(rows), same_name))
    assert "not computed" not in _markdown(moe_budget(results_frame(rows), [same_name, TOY], tflops=500))
    bare = ModelConfig("toy", hidden=4096, num_experts=16, topk=4)
    assert "not computed: no moe_intermediate in model toy" in _markdown(
        moe_budget(_frame(**{BUSIEST_COLUMN: 10}), bare)
    )
    balanced_only = results_frame([balanced_row(4, 1 << 20, 50.0)], load_spec("hgx-h100"))
    assert moe_budget(balanced_only, TOY) is None


def test_html_and_cpu_note():
    frame = _frame(**{BUSIEST_COLUMN: SELECTIONS})
    text = html_page("budget", [moe_budget(frame, TOY, tflops=None)])
    assert '<div class="wide"><table>' in text and "<li>toy at 1648 TFLOPs/GPU" in text
    assert "not a GPU fabric" not in text
    frame["emulated"] = True
    assert "not a GPU fabric" in html_page("budget", [moe_budget(frame, TOY, tflops=None)])


@pytest.mark.parametrize("backend", ["gloo", "shmem-emu", "mock"])
def test_cpu_times_are_shown_but_not_judged(backend):
    # A CPU host's all-to-all says nothing about whether training hides a GPU fabric's: no verdict line.
    text = _markdown(moe_budget(_frame(**{BUSIEST_COLUMN: SELECTIONS, "backend": backend}), TOY, tflops=500))
    assert f"not judged: CPU all-to-all times ({backend}), not a GPU fabric's" in text
    table, notes = text.split("\n\n", 1)
    assert "| not judged" in table and "no / no" not in table
    assert "cannot hide" not in notes and "hides it" not in notes
    assert "300.0" in text  # the table still shows the figures
