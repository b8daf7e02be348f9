"""BENCHMARKS.md and docs/benchmark-history.md are what ``python -m benchmarks.report`` renders from
``benchmarks/results/`` (no hand edits), measured results first and no generated sentence repeated (issue 46)."""

from __future__ import annotations

import collections
import re

from benchmarks import common, report


def test_the_committed_files_are_the_reports_output():
    rendered = report.render()
    assert set(rendered) == {common.ROOT / "BENCHMARKS.md", common.ROOT / "docs" / "benchmark-history.md"}
    for path, text in rendered.items():
        assert path.read_text() == text, f"{path.name} is not the report's output: run python -m benchmarks.report"


def test_measured_first_then_one_table_of_predictions():
    text = (common.ROOT / "BENCHMARKS.md").read_text()
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads == ["## Measured on GPUs", "## Measured on the CPU", "## GPU tables", "## CPU tables",
                     "## Predicted (not measured)", "## History"]
    first_screen = "\n".join(text.splitlines()[:45])  # the H100's headline table and the CPU's targets
    assert "| micro-batch 64, one step | 176.6 ms" in first_screen and "| small: jaxgpt default" in first_screen
    predicted = text.split("## Predicted (not measured)")[1].split("## History")[0]
    assert predicted.count("| program | GPU |") == 1 and "**Predictions, not measurements**" in predicted
    assert "Issue 32: the changes" not in text  # the history is its own file
    assert "### Issue 32: the changes, one row each" in (common.ROOT / "docs" / "benchmark-history.md").read_text()


def test_no_generated_sentence_is_repeated():
    """Prose only (table rows repeat their cells' words by design): no sentence of 40 characters or more twice."""
    for path in (common.ROOT / "BENCHMARKS.md", common.ROOT / "docs" / "benchmark-history.md"):
        seen = collections.Counter(s for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("|")
                                   for s in re.split(r"(?<=\.)\s+", ln) if len(s) >= 40)
        assert not [s for s, n in seen.items() if n > 1], (path.name, [s[:80] for s, n in seen.items() if n > 1])
