"""protocol/path_trace.py's points and bench/latency_path.py's lining up of them (pure
logic: no deployment)."""

from __future__ import annotations

import pytest

from blockserve.bench import latency_path
from blockserve.protocol import path_trace
from blockserve.protocol.path_trace import POINTS


def test_marks_are_written_only_when_tracing_is_on(tmp_path, monkeypatch):
    monkeypatch.setattr(path_trace, "_log", None)
    monkeypatch.setattr(path_trace, "DIRECTORY", None)
    path_trace.mark("router: admitted")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(path_trace, "DIRECTORY", str(tmp_path / "trace"))
    path_trace.mark("router: admitted")
    path_trace.mark("router: first chunk read")
    path_trace._log.close()
    marks = latency_path.read_marks(tmp_path / "trace")
    assert [point for _, point in marks] == ["router: admitted", "router: first chunk read"]
    assert marks[0][0] <= marks[1][0]


def test_every_point_named_in_the_code_is_a_known_point():
    """A point renamed in the code but not in POINTS would drop out of the split."""
    import pathlib
    import re

    root = pathlib.Path(path_trace.__file__).resolve().parent.parent
    named = {m for source in [*root.glob("router/*.py"), *root.glob("replica/*.py")]
             for m in re.findall(r'\bmark\("([^"]+)"\)', source.read_text())}
    assert named == set(POINTS[1:-1])


def test_points_line_up_with_the_request_they_passed_during_and_segments_add_up():
    rows = [{POINTS[0]: 10.0, POINTS[-1]: 10.010, "end": 10.020},
            {POINTS[0]: 20.0, POINTS[-1]: 20.012, "end": 20.030}]
    marks = [(9.5, "router: handler entered"),  # a warm-up request's, before the first send
             (10.002, "router: handler entered"), (10.008, "router: first text relayed"),
             (20.003, "router: handler entered"), (20.009, "router: first text relayed")]
    lined = latency_path.line_up(rows, marks)
    assert lined[0]["router: handler entered"] == 10.002
    figures = latency_path.split(lined)
    assert figures["requests"] == 2
    assert figures["ms_since_sent"]["router: handler entered"] == pytest.approx(2.5)
    assert figures["ms_since_sent"][POINTS[-1]] == pytest.approx(11.0)
    segments = figures["segments_ms"]
    assert list(segments) == [f"{POINTS[0]} -> router: handler entered",
                              "router: handler entered -> router: first text relayed",
                              f"router: first text relayed -> {POINTS[-1]}"]
    assert segments["router: handler entered -> router: first text relayed"] == pytest.approx(6.0)


def test_a_point_that_some_request_missed_is_left_out_of_the_segments():
    rows = [{POINTS[0]: 1.0, POINTS[-1]: 1.01, "end": 1.02},
            {POINTS[0]: 2.0, POINTS[-1]: 2.01, "end": 2.02}]
    lined = latency_path.line_up(rows, [(1.005, "router: admitted")])
    assert list(latency_path.split(lined)["segments_ms"]) == [f"{POINTS[0]} -> {POINTS[-1]}"]
