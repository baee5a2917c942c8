"""`swarm experiment convergence --replicas R`: every stage trains as R in-process replicas whose gradient sums are
counted in the totals, at fp32 in the fp32 setting (its own fp32 equivalent)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from swarm.experiments import convergence
from swarm.model.data import build_datasets


class _Bar:
    def set_postfix_str(self, text: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


def config(*argv: str) -> convergence.ExperimentConfig:
    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    return convergence.config_from_args(parser.parse_args(["--quick", *argv]))


def sums(replicas: int) -> tuple[int, int, int]:
    """(bytes the replicas' sums sent, every byte, every byte's fp32 equivalent) of one quick fp32 epoch."""
    cfg = replace(config("--replicas", str(replicas)), epochs=1)
    train, held_out, _ = build_datasets(cfg.data)
    setting = convergence.Setting.parse("fp32/fp32")
    steps = convergence._run_setting(setting, cfg, train, held_out, _Bar()).steps
    total = sum(s["total_wire_bytes"] for s in steps)
    other = sum(s["forward_bytes"] + s["backward_bytes"] + s["sync_bytes"] + s["control_bytes"] for s in steps)
    return total - other, total, sum(s["fp32_total_wire_bytes"] for s in steps)


def test_the_flag_sets_the_replicas():
    assert config().replicas == 1 and config("--replicas", "3").replicas == 3


def test_replicas_sums_count_in_the_totals():
    one, two = sums(1), sums(2)
    assert one[0] == 0 and two[0] > 0.25 * two[1]  # the fp32 sums: a large share of a replicated run's bytes
    assert two[2] >= two[1] and two[2] - one[2] >= two[0]  # the sums' fp32 equivalent is counted in the fp32 total
