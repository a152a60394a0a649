"""The block lab's figure stays readable with long `--configs` labels (a swept policy with
its kwargs): matplotlib lays it out without giving up (it warns when it cannot)."""

import dataclasses
import warnings

from blockserve.bench.block_lab import RunResult, plot

LABELS = [f"scheduler.block_retention=my_policy:HeadsStayTailsGo, "
          f"scheduler.block_retention.keep_positions={k}" for k in (0, 4, 8)]


def test_the_figure_lays_out_long_labels(tmp_path):
    fields = {f.name: 1 for f in dataclasses.fields(RunResult)}
    results = {"cross_tenant": {label: RunResult(**fields) for label in LABELS}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" fails the test
        plot(results, tmp_path / "lab.png")
    assert (tmp_path / "lab.png").stat().st_size > 0
