"""The churn experiment's byte accounting (issue 29): every row carries the run's total bytes and their fp32
equivalent, split into boundaries, the tied sum, the replicas' sums, control and the stage state the peers moved
(read from their logs), judged against >= 20x; and --settings runs one setting alone."""

from __future__ import annotations

import argparse

import pytest

from swarm.experiments import churn
from swarm.experiments.churn import ChurnConfig, swarm_flags
from swarm.experiments.churn_report import BYTES_TARGET, ROW_KEYS, byte_split, targets
from swarm.metrics import STATE_SENT_LOG, logged_state_bytes

AVG0, AVG1 = "swarm_wire_bytes_total{direction=average,link=0}", "swarm_wire_bytes_total{direction=average,link=1}"


def step(**values) -> dict:
    row = {"forward_bytes": 100, "backward_bytes": 50, "sync_bytes": 20, "control_bytes": 5, AVG0: 10, AVG1: 15}
    row.update(values)
    row.setdefault("total_wire_bytes", 100 + 50 + 20 + 5 + 10 + 15 + 1)  # 1 byte of something else
    row.setdefault("fp32_total_wire_bytes", 5000)
    return row


def test_the_split_reads_the_average_counters_and_totals():
    split = byte_split([step(), step()])
    assert split == {
        "total_wire_bytes": 402, "fp32_total_wire_bytes": 10000, "boundary_bytes": 300, "tied_bytes": 40,
        "control_bytes": 10, "replica_sum_bytes": 50, "tensor_ratio_vs_fp32": (10000 - 10) / (402 - 10),
        "state_bytes": None,
    }  # fmt: skip
    assert "total_wire_bytes" in ROW_KEYS and "fp32_total_wire_bytes" in ROW_KEYS


def test_without_average_columns_the_sums_are_the_rest_and_without_totals_nothing_is_claimed():
    rows = [{k: v for k, v in step().items() if k not in (AVG0, AVG1)}]
    assert byte_split(rows)["replica_sum_bytes"] == 201 - 175
    assert set(byte_split([{"forward_bytes": 1}]).values()) == {None}


def row(total: int, fp32: int) -> dict:
    split = byte_split([step(total_wire_bytes=total, fp32_total_wire_bytes=fp32)])
    return {"setting": "no-churn", "samples_lost": 0, "samples_duplicated": 0, "steps": 1, **split}


@pytest.mark.parametrize(("fp32", "passed"), [(20 * 400, True), (20 * 400 - 1, False)])
def test_the_bytes_target_is_judged_on_the_no_churn_row(fp32, passed):
    (check,) = [c for c in targets([row(400, fp32)]) if "fewer total bytes" in c.name]
    assert check.passed is passed and f">= {BYTES_TARGET:g}x" in check.name and "replicas' sums" in check.value


def test_state_the_peers_moved_is_read_from_their_logs_and_counted_in_both_totals(tmp_path):
    logs = tmp_path / "logs"
    assert logged_state_bytes(logs) is None, "no logs: not read, which is not 0"
    logs.mkdir()
    (logs / "peer0.log").write_text(
        f"12:00 INFO swarm.runtime.service: {STATE_SENT_LOG} 5328280 bytes (stage 0) to Qm1\n"
        "12:01 INFO swarm.daemon.replication: holding a copy of layers [2, 3) at step 22\n"
        f"12:02 INFO swarm.runtime.service: {STATE_SENT_LOG} 1000 bytes (stage 1) to Qm2\n"
    )
    (logs / "peer1.log").write_text(f"x {STATE_SENT_LOG} 7 bytes (stage 2) to Qm3\n")
    (logs / "trainer.log").write_text("nothing sent\n")
    moved = logged_state_bytes(logs)
    assert moved == 5328280 + 1000 + 7
    split = byte_split([step()], moved)
    assert split["state_bytes"] == moved
    assert (split["total_wire_bytes"], split["fp32_total_wire_bytes"]) == (201 + moved, 5000 + moved)
    assert split["tensor_ratio_vs_fp32"] == byte_split([step()])["tensor_ratio_vs_fp32"], "the codecs' ratio alone"
    no_churn = {"setting": "no-churn", "samples_lost": 0, "samples_duplicated": 0, "steps": 1, **split}
    (check,) = [c for c in targets([no_churn]) if "fewer total bytes" in c.name]
    assert "stage state moved 5.3 MB" in check.value and check.passed is False


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    churn.add_arguments(parser)
    return churn._FLAGS.from_args(parser.parse_args(list(argv)))


def test_settings_runs_one_setting_and_refuses_unknown_ones():
    assert parse().settings == ("no-churn", "churn")
    assert parse("--settings", "no-churn").settings == ("no-churn",)
    with pytest.raises(ValueError, match="one or both of no-churn, churn"):
        parse("--settings", "no-churn,storm")


def test_verify_fraction_reaches_the_trainer_only_when_given_and_is_checked():
    _, trainer = swarm_flags(ChurnConfig(), "no-churn", {})
    assert "--verify-fraction" not in trainer  # the trainer's own default
    _, trainer = swarm_flags(parse("--verify-fraction", "0").config(), "no-churn", {})
    assert trainer[trainer.index("--verify-fraction") + 1] in ("0", "0.0")
    with pytest.raises(ValueError, match="--verify-fraction"):
        ChurnConfig(verify_fraction=1.5)


def test_the_tensor_ratio_leaves_out_the_control_bytes_both_totals_carry():
    split = byte_split([step(total_wire_bytes=1000, fp32_total_wire_bytes=20000, control_bytes=900)])
    assert split["tensor_ratio_vs_fp32"] == (20000 - 900) / (1000 - 900)
    (check,) = [c for c in targets([row(1000, 20000)]) if "fewer total bytes" in c.name]
    assert "tensors alone" in check.value


def test_flag_support_reads_this_checkout_s_parsers_in_process():
    assert churn.flag_support() == dict.fromkeys((*churn.OPTIONAL_PEER_FLAGS, *churn.OPTIONAL_TRAINER_FLAGS), True)
