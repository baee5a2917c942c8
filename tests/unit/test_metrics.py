"""The metrics registry: one table, per-object registries, flattened snapshots and the text exposition."""

from __future__ import annotations

import re

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from swarm.metrics import METRICS, Metrics, MetricSpec, delta, sample_key, total


def test_every_table_row_is_an_attribute_on_the_objects_own_registry():
    m = Metrics()
    for spec in METRICS:
        metric = getattr(m, spec.attr)
        assert isinstance(metric, spec.kind), spec.attr
    names = {family.name for family in m.registry.collect()}
    assert {spec.name.removesuffix("_total") for spec in METRICS} <= names
    assert REGISTRY.get_sample_value("swarm_steps_total") is None, "nothing lands on the global default registry"


def test_the_brief_names_and_labels_are_the_table():
    by_attr = {spec.attr: spec for spec in METRICS}
    assert by_attr["wire_bytes"].name == "swarm_wire_bytes_total"
    assert by_attr["wire_bytes"].labels == by_attr["fp32_bytes"].labels == ("link", "direction")
    assert by_attr["phase_seconds"].labels == ("stage", "phase")
    assert by_attr["buffer_hits"].name == "swarm_aqsgd_buffer_hits_total"
    assert by_attr["buffered_samples"].labels == ("link",)
    assert len({spec.name for spec in METRICS}) == len({spec.attr for spec in METRICS}) == len(METRICS)


def test_two_metrics_objects_count_apart():
    a, b = Metrics(), Metrics()
    a.wire_bytes.labels(link=0, direction="forward").inc(100)
    a.steps.inc()
    b.steps.inc(3)
    sa, sb = a.snapshot(), b.snapshot()
    assert sa['swarm_wire_bytes_total{direction="forward",link="0"}'] == 100.0
    assert 'swarm_wire_bytes_total{direction="forward",link="0"}' not in sb
    assert (sa["swarm_steps_total"], sb["swarm_steps_total"]) == (1.0, 3.0)


def test_snapshot_keys_sort_labels_and_flatten_histograms():
    m = Metrics()
    m.phase_seconds.labels(stage=1, phase="encode").observe(0.002)
    m.loss.set(4.5)
    m.plan_version.set(2)
    snap = m.snapshot()
    assert snap['swarm_phase_seconds_count{phase="encode",stage="1"}'] == 1.0
    assert snap['swarm_phase_seconds_sum{phase="encode",stage="1"}'] == pytest.approx(0.002)
    assert snap['swarm_phase_seconds_bucket{le="+Inf",phase="encode",stage="1"}'] == 1.0
    assert snap["swarm_loss"] == 4.5 and snap["swarm_plan_version"] == 2.0
    assert all(isinstance(v, float) for v in snap.values())
    assert not any("_created" in k for k in snap), "creation timestamps are no figure of the run"
    assert sample_key("x", {"b": "2", "a": 'q"uote'}) == 'x{a="q\\"uote",b="2"}'


def test_delta_and_total_give_per_step_figures():
    m = Metrics()
    m.wire_bytes.labels(link=0, direction="forward").inc(10)
    before = m.snapshot()
    m.wire_bytes.labels(link=0, direction="forward").inc(5)
    m.wire_bytes.labels(link=1, direction="backward").inc(7)  # first seen after `before`
    m.sync_bytes.inc(2)
    step = delta(before, m.snapshot(), "swarm_wire_bytes")
    assert step == {
        'swarm_wire_bytes_total{direction="forward",link="0"}': 5.0,
        'swarm_wire_bytes_total{direction="backward",link="1"}': 7.0,
    }
    assert total(step, "swarm_wire_bytes_total") == 12.0
    assert total(step, "swarm_wire_bytes_total", direction="backward") == 7.0
    assert total(step, "swarm_wire_bytes_total", link=0, direction="backward") == 0.0


def test_text_is_prometheus_exposition_with_every_name():
    m = Metrics()
    m.buffer_hits.labels(link=0).inc(3)
    text = m.text().decode()
    for spec in METRICS:
        # the TYPE line of a counter carries `_total` or not depending on the client's version
        assert re.search(rf"^# TYPE {spec.name.removesuffix('_total')}(_total)? ", text, re.M), spec.name
    assert 'swarm_aqsgd_buffer_hits_total{link="0"} 3.0' in text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": Counter, "name": "swarm_x"},
        {"kind": Gauge, "name": "swarm_x_total"},
        {"kind": Histogram, "name": "swarm_x"},
        {"kind": Gauge, "name": "swarm_x", "buckets": (1.0,)},
        {"kind": dict, "name": "swarm_x"},
    ],
)
def test_spec_rejects_inconsistent_rows(kwargs):
    with pytest.raises(ValueError):
        MetricSpec(attr="x", help="h", **kwargs)
