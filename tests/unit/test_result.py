"""`Result` as Ray Train users read it: `metrics` is the last report (a dict), the history is beside it."""

from __future__ import annotations

import pytest

from ray_elastic import Result


def test_metrics_is_the_last_report_and_the_history_keeps_every_one_in_order():
    result = Result(return_value=None, metrics_history=[{"loss": 2.0}, {"loss": 1.0}], metric_times=[10.0, 11.0])
    assert result.metrics["loss"] == 1.0, "result.metrics['loss'] reads the last report, as in Ray Train"
    assert [m["loss"] for m in result.metrics_history] == [2.0, 1.0]
    assert Result(return_value=None).metrics == {}


def test_the_dataframe_has_a_row_per_report_and_when_it_came():
    pd = pytest.importorskip("pandas")
    result = Result(return_value=None, metrics_history=[{"loss": 2.0}, {"loss": 1.0, "acc": 0.5}], metric_times=[1, 2])
    frame = result.metrics_dataframe
    assert isinstance(frame, pd.DataFrame)
    assert list(frame["loss"]) == [2.0, 1.0] and list(frame["time"]) == [1, 2]
    assert frame["acc"].isna().tolist() == [True, False]
