"""The scaling report reads the metric names LitLM logs (lit/training/metric_names.py)."""

from lit.experiments.scaling_report import window_keys, window_label, window_span
from lit.training import metric_names


def results_with(*keys: str) -> list[dict]:
    return [{"metrics": dict.fromkeys(keys, 1.0)}]


def test_report_fits_the_validation_windows_litlm_logs():
    late, early = metric_names.position_loss("val", 2048, 4096), metric_names.position_loss("val", 0, 2048)
    logged = [late, metric_names.trailing_loss("val"), early, metric_names.loss("val"),
              metric_names.bits_per_byte("val"), metric_names.perplexity("val"),
              metric_names.position_loss("test", 0, 2048), metric_names.loss("train")]
    assert window_keys(results_with(*logged)) == [metric_names.loss("val"), metric_names.trailing_loss("val"),
                                                  early, late]
    assert window_span(late) == (2048, 4096)
    assert window_label(early) == "positions 0-2k"
