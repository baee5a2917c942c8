"""Compact audits (`VerifyConfig.records` "fp16" and "sketch"): every attack of test_verify is caught as fast as
with fp32 records, clean runs pass without asking again and move half (fp16) or a fifth (sketch) of the bytes,
and a stage cannot show one record compact and another in fp32."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import DEFAULT_BACKWARD_CODEC, DEFAULT_FORWARD_CODEC, CodecConfig
from swarm.model.data import Batch
from swarm.model.gpt import ModelConfig
from swarm.runtime.inprocess import LocalPipeline
from swarm.runtime.verify import VerifyConfig
from tests.unit.runtime.test_verify import (
    ATTACKS,
    CFG,
    FP32,
    HEARTBEAT_S,
    STEPS,
    _consistent,
    _sends_scaled,
    batch,
    run,
)

torch.set_num_threads(1)

COMPACT = {"records": "fp16"}
WIDE = ModelConfig(vocab_size=64, seq_len_tokens=64, hidden_dim=64, n_layers=2, n_heads=4, init_seed=1)


def wide_batch(step: int, n: int = 8) -> Batch:
    windows = torch.randint(
        0, WIDE.vocab_size, (n, WIDE.seq_len_tokens + 1), generator=torch.Generator().manual_seed(step)
    )
    return Batch(torch.arange(n), windows[:, :-1], windows[:, 1:])


@pytest.fixture
def pipe():
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    yield pipe
    pipe.close()


def _caught_at(attack: str, records: str) -> tuple[int | None, list, object]:
    """The step a fresh pipeline with `attack`'s liar evicts it at under `records`, the evicted (True: the liar),
    the stats."""
    pipe = LocalPipeline(CFG, 2, FP32, FP32, replicas=2)
    try:
        lie, stage = ATTACKS[attack]
        liar = pipe.replica_hosts[stage][1]
        lie(liar.worker)
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(seed=11, records=records))
        for step in range(STEPS):
            driver.train_step(step, batch(step))
            if driver.liars:
                return step, [p == liar.peer_id for p, _ in driver.liars], driver.verifier.stats
        return None, [], driver.verifier.stats
    finally:
        pipe.close()


@pytest.mark.parametrize("records", ["fp16", "sketch"])
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_compact_audits_catch_each_liar_as_fast_as_fp32_records(attack, records):
    """The bound test_verify holds fp32 audits to: the liar, and only it, evicted before its probation ends (the
    routes' shares follow measured throughput, so the exact step may differ between two runs of either kind). A
    compact check that fails is asked again in fp32 and judged as an fp32 audit."""
    caught, liars, stats = _caught_at(attack, records)
    assert caught is not None and caught < VerifyConfig().probation_steps, f"{attack}: caught at {caught}"
    assert liars == [True]
    if attack != "stops updating":  # that one is caught by the weights' digests, not by an audit
        assert stats.escalations >= 1


def test_a_clean_run_with_the_default_codecs_passes_compact_audits_without_asking_again_at_a_fraction_of_the_bytes():
    """A model whose boundary tensors (2 x 64 x 64) outgrow a sketch (1024 buckets): the sketched audit moves what
    the siblings recompute from in fp16, sketches of the rest."""
    forward, backward = CodecConfig.parse(DEFAULT_FORWARD_CODEC), CodecConfig.parse(DEFAULT_BACKWARD_CODEC)
    control = {}
    for records in ("fp32", "fp16", "sketch"):
        pipe = LocalPipeline(WIDE, 2, forward, backward, replicas=2)
        try:
            driver = pipe.driver(
                4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=11, records=records)
            )
            control[records] = sum(driver.train_step(step, wide_batch(step)).control_bytes for step in range(3))
            stats = driver.verifier.stats
            assert driver.liars == [] and stats.disputes == 0 and stats.escalations == 0 and stats.audits >= 6
            # the compact inputs' rounding moves a recomputation well inside the own check's tolerance
            assert stats.worst_own < VerifyConfig().rtol * 0.5
            assert 0 < stats.worst_link < VerifyConfig().link_rtol
        finally:
            pipe.close()
    assert control["fp16"] < 0.6 * control["fp32"] and control["sketch"] < 0.6 * control["fp16"], control


@pytest.mark.parametrize("records", ["fp16", "sketch"])
def test_a_liar_that_records_honestly_but_sends_scaled_is_caught_under_compact_audits(pipe, records):
    liar = pipe.replica_hosts[0][1]
    _sends_scaled(liar, 10.0)
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=3, records=records))
    driver.train_step(0, batch(0))
    assert [p for p, _ in driver.liars] == [liar.peer_id] and "sent an activation" in driver.liars[0][1]


def test_a_lie_within_the_codecs_error_passes_compact_audits_as_it_passes_fp32_ones(pipe):
    _sends_scaled(pipe.replica_hosts[0][1], 1.5)
    driver, caught = run(pipe, 2, VerifyConfig(fraction=1.0, seed=3, **COMPACT))
    assert caught is None and driver.verifier.stats.worst_link == pytest.approx(0.5, rel=1e-3)
    assert driver.verifier.stats.escalations == 0


@pytest.mark.parametrize("records", ["fp16", "sketch"])
def test_a_consistent_liar_is_refereed_under_compact_audits(pipe, records):
    liar = pipe.replica_hosts[1][1]
    _consistent(10.0)(liar.worker)
    driver, caught = run(pipe, STEPS, VerifyConfig(seed=11, records=records))
    assert caught is not None and [p for p, _ in driver.liars] == [liar.peer_id]
    assert "off the trainer's" in driver.liars[0][1]


def _two_faced_step(pipe: LocalPipeline, liar, records: str, b):
    """One audited step in which `liar` shows, in its compact reply only, a record whose output (stage 1: its loss)
    is x3 of what it computed, then answers the fp32 re-ask with the honest record; the driver."""
    import swarm.runtime.service as service

    honest_reply, honest_record = service.audit_reply, liar.audit_record
    marked = [None]

    def two_faced(record, is_first, is_last, backward, compact=False, *sketch):
        if compact and record is marked[0]:
            record = type(record)(record.inputs, record.output * 3, record.grad_received, record.grad_sent)
        return honest_reply(record, is_first, is_last, backward, compact, *sketch)

    def mark(*args):
        marked[0] = honest_record(*args)
        return marked[0]

    liar.audit_record = mark
    service.audit_reply = two_faced
    try:
        driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=3, records=records))
        driver.train_step(0, b)
    finally:
        service.audit_reply = honest_reply
    return driver


@pytest.mark.parametrize("records", ["fp16", "sketch"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_whose_fp32_record_is_not_its_compact_one_is_a_liar(pipe, stage, records):
    """A stage that shows a record in fp16 that fails a check, then another in fp32 that would pass: it reported
    two records of one micro-batch."""
    liar = pipe.replica_hosts[stage][0]
    driver = _two_faced_step(pipe, liar, records, batch(0))
    assert [p for p, _ in driver.liars] == [liar.peer_id], driver.liars
    why = "loss record" if stage else "output record does not round to"  # 2 x 16 x 32: too small to sketch
    assert why in driver.liars[0][1]


@pytest.mark.parametrize("records", ["fp16", "sketch"])
def test_a_stage_that_ignores_compact_and_answers_fp32_passes(pipe, records):
    """A stage of an older version answers fp32 (it does not know the field): taken as it is."""
    import swarm.runtime.service as service

    honest_reply = service.audit_reply
    honest_recompute = service.recompute_reply
    service.audit_reply = lambda record, first, last, backward, *compact: honest_reply(record, first, last, backward)
    service.recompute_reply = lambda done, *compact: honest_recompute(done)
    try:
        driver, caught = run(pipe, 2, VerifyConfig(fraction=1.0, seed=3, records=records))
    finally:
        service.audit_reply, service.recompute_reply = honest_reply, honest_recompute
    stats = driver.verifier.stats
    assert caught is None and stats.escalations == 0 and stats.audits > 0
    assert stats.worst_own == 0.0 or records == "sketch"  # fp32 values, sketched by the trainer: about 1e-16


def test_records_must_name_a_known_encoding():
    with pytest.raises(ValueError, match="records"):
        VerifyConfig(records="int3")


def test_a_steps_control_bytes_are_split_by_call_method(pipe):
    """steps.csv's control bytes by kind: the driver counts each call's bytes under its method too."""
    driver = pipe.driver(4, heartbeat_s=HEARTBEAT_S, verify=VerifyConfig(fraction=1.0, seed=3, **COMPACT))
    result = driver.train_step(0, batch(0))
    prefix = "swarm_control_call_bytes_total"
    by_method = {k[len(prefix) :]: v for k, v in result.counters.items() if k.startswith(prefix)}
    assert {'{method="Audit"}', '{method="Recompute"}', '{method="Step"}'} <= set(by_method), by_method
    assert sum(by_method.values()) == pytest.approx(result.control_bytes, rel=0.01)
    assert by_method['{method="Audit"}'] + by_method['{method="Recompute"}'] > 0.5 * result.control_bytes


def test_a_stage_whose_fp32_record_does_not_sketch_to_the_sketch_it_reported_is_a_liar():
    """The sketched field of a two-faced record (stage 0's output, 2 x 64 x 64: sketched)."""
    pipe = LocalPipeline(WIDE, 2, FP32, FP32, replicas=2)
    liar = pipe.replica_hosts[0][0]
    try:
        driver = _two_faced_step(pipe, liar, "sketch", wide_batch(0))
    finally:
        pipe.close()
    assert [p for p, _ in driver.liars] == [liar.peer_id], driver.liars
    assert "output record does not sketch to the one it reported first" in driver.liars[0][1]
