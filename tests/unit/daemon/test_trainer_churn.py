"""The trainer under churn: it drives the plan's columns, writes the churn columns of its step rows, and when
no route is left (NoLiveRoute, or a dead stage of a plan of one route) waits for a newer plan and runs the step
there: no step lost, none run twice."""

from __future__ import annotations

import csv
import time
from types import SimpleNamespace

import grpc
import pytest

from swarm.model.gpt import ModelConfig
from swarm.net.stream import StageCallError
from swarm.peers.records import PeerAnnouncement, PlanRecord
from swarm.peers.routes import PlanRoutes
from swarm.train.follower import no_route_left
from swarm.train.steplog import step_columns
from swarm.train.trainer import TrainConfig, train

TINY = ModelConfig(vocab_size=64, seq_len_tokens=8, hidden_dim=32, n_layers=2, n_heads=2)


class NoLiveRoute(StageCallError):  # R2's exception, by name (swarm.runtime.driver once merged)
    pass


def ann(pid: str, stage: int, version: int) -> PeerAnnouncement:
    return PeerAnnouncement(
        pid, f"127.0.0.1:{5000 + int(pid[1:], 16)}", "cpu", 1, 1.0,
        stage=stage, layer_start=stage, layer_end=stage + 1, plan_version=version,
    )  # fmt: skip


def plan(version: int, rows: list[list[str]], trainer: str = "me") -> PlanRecord:
    stages = [{"layer_start": s, "layer_end": s + 1, "peer_ids": r} for s, r in enumerate(rows)]
    return PlanRecord(version=version, document={"stages": stages, "trainer_ids": [trainer]}, created_at=1.0)


def test_the_plans_route_is_its_columns_once_every_replica_follows():
    record = plan(4, [["p1", "p2"], ["p3", "p4"]])
    peers = [ann("p1", 0, 4), ann("p2", 0, 4), ann("p3", 1, 4), ann("p4", 1, 3)]
    assert record.document.route_of(peers, record.version) is None, "p4 still switching"
    peers[3] = ann("p4", 1, 4)
    route = record.document.route_of(peers, record.version)
    assert route.replica_peer_ids == (("p1", "p2"), ("p3", "p4")) and route.n_replicas == 2
    assert route.peer_ids == ["p1", "p3"], "chain 0 for single-chain callers"
    addresses, ids = route.driver_args()
    assert ids == (["p1", "p2"], ["p3", "p4"]) and addresses[1] == ["127.0.0.1:5003", "127.0.0.1:5004"]
    one = plan(4, [["p1"], ["p3"]]).document.route_of(peers, 4)
    assert one.driver_args() == (["127.0.0.1:5001", "127.0.0.1:5003"], ["p1", "p3"]), "flat for one route"


def test_step_columns_from_a_replicated_driver_and_a_plain_one():
    r2 = SimpleNamespace(attempts=2, routes=1, dead_peers=("p2",), sample_ids=(5, 1))
    assert step_columns(r2, (5, 1), 2) == {"attempts": 2, "chains": 1, "dead_peers": "p2", "sample_ids": "5 1"}
    assert step_columns(SimpleNamespace(), (3, 4), 1, retries=1) == {
        "attempts": 2, "chains": 1, "dead_peers": "", "sample_ids": "3 4",
    }  # fmt: skip


def test_which_failures_wait_for_a_new_plan():
    one, two = PlanRoutes(["a"], ["p"]), PlanRoutes(["a"], ["p"], 1, (("a", "b"),), (("p", "q"),))
    assert no_route_left(NoLiveRoute("stage 1 has no live replica"), two)
    assert no_route_left(StageCallError("stage 0: unreachable", grpc.StatusCode.UNAVAILABLE), one)
    assert not no_route_left(StageCallError("stage 0: unreachable", grpc.StatusCode.UNAVAILABLE), two), (
        "with replicas the driver reroutes; what reaches the trainer is not a dead replica"
    )
    assert not no_route_left(StageCallError("invalid", grpc.StatusCode.INVALID_ARGUMENT), one)


def test_the_drivers_own_no_live_route_waits_for_a_new_plan():
    """The trainer knows the driver's exception by name (no import of the runtime at module load): the real
    class, not only this module's stand-in, must be recognised, so a rename on one side fails here."""
    from swarm.runtime.routing import NoLiveRoute as DriverNoLiveRoute

    two = PlanRoutes(["a"], ["p"], 1, (("a", "b"),), (("p", "q"),))
    assert no_route_left(DriverNoLiveRoute("stage 1 has no live replica", grpc.StatusCode.UNAVAILABLE), two)


class FakeDriver:
    """Stands for PipelineDriver: fails the first step it runs on plan 1 with `failure`."""

    made: list[tuple] = []
    calls: list[tuple[int, int]] = []
    failure: Exception | None = None

    def __init__(
        self, route, peers, schedule, n_micro, deadline_s, plan_version, metrics, signer, weights=None, tied=True, **_
    ):
        self.plan_version, self.n_stages = plan_version, len(route)
        FakeDriver.made.append((route, peers, plan_version))

    def check_model(self, identity, label=""):
        return []  # every fake stage serves the trainer's model (and reports no frozen prefix)

    def train_step(self, step, batch):
        FakeDriver.calls.append((step, self.plan_version))
        if self.plan_version == 1 and FakeDriver.failure is not None:
            failure, FakeDriver.failure = FakeDriver.failure, None
            raise failure
        traffic = SimpleNamespace(forward_bytes=1, backward_bytes=1, fp32_wire_bytes=4, link_bytes={})
        return SimpleNamespace(
            loss=1.0, lr=0.1, grad_norm=1.0, forward_bytes=1, backward_bytes=1, fp32_wire_bytes=4, sync_bytes=0,
            reduce_bytes=0, seconds=0.01, traffic=traffic, counters={}, attempts=1,
            routes=2 if self.plan_version == 1 else 1, dead_peers=(),
            sample_ids=tuple(int(i) for i in batch.sample_ids), control_bytes=0, total_wire_bytes=0,
            fp32_total_wire_bytes=0, skipped=False, loss_scale=0.0,
        )  # fmt: skip

    def close(self):
        pass


@pytest.mark.parametrize(
    "failure,replicas",
    [
        (NoLiveRoute("stage 1 has no live replica"), 2),
        (StageCallError("stage 1: unreachable", grpc.StatusCode.UNAVAILABLE), 1),
    ],
    ids=["no-live-chain", "one-chain-unreachable"],
)
def test_no_live_chain_waits_for_the_repaired_plan_and_runs_the_step_there(tmp_path, monkeypatch, failure, replicas):
    import swarm.runtime.driver

    monkeypatch.setattr(swarm.runtime.driver, "PipelineDriver", FakeDriver)
    FakeDriver.made, FakeDriver.calls, FakeDriver.failure = [], [], failure
    v1 = plan(1, [["p1", "p2"][:replicas], ["p4", "p3"][:replicas]])
    peers = v1_peers = [ann("p1", 0, 1), ann("p2", 0, 1), ann("p4", 1, 1), ann("p3", 1, 1)]
    state = {"plan": v1, "peers": peers}

    def get_plan(n_layers=None, peers=None):
        if FakeDriver.failure is None:  # after the failure: the planner's repair, p5 took p4's place
            state["plan"] = plan(2, [["p1", "p2"][:replicas], ["p5", "p3"][:replicas]])
            state["peers"] = [*(dataclass_v(p, 2) for p in v1_peers if p.peer_id != "p4"), ann("p5", 1, 2)]
        return state["plan"]

    dht = SimpleNamespace(peer_id="me", peers=lambda: state["peers"], get_plan=get_plan)
    cfg = TrainConfig(model=TINY, train_samples=8, batch_size=4, micro_batches=2, steps=3, out=str(tmp_path),
                      replan_timeout_s=30.0, eval_samples=0)  # fmt: skip
    route = v1.document.route_of(peers, v1.version)
    summary = train(cfg, route, quiet=True, dht=dht)
    assert summary.steps == 3 and summary.replans == 1
    assert FakeDriver.calls[0] == (0, 1) and FakeDriver.calls[1] == (0, 2), "step 0 ran again on plan 2"
    assert [s for s, _ in FakeDriver.calls[1:]] == [0, 1, 2], "no step lost or run twice"
    columns = (["p1", "p2"], ["p5", "p3"]) if replicas == 2 else ["p1", "p5"]
    assert FakeDriver.made[-1][1] == columns, "the driver gets the plan's columns"
    with open(tmp_path / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["attempts"] for r in rows] == ["2", "1", "1"] and [r["plan_version"] for r in rows] == ["2", "2", "2"]
    ids = [int(i) for r in rows for i in r["sample_ids"].split()]
    assert len(ids) == 12 and all(len(r["sample_ids"].split()) == 4 for r in rows)
    done = [float(r["time"]) for r in rows]  # completion times: the churn experiment's recovery clock
    assert done == sorted(done) and abs(done[-1] - time.time()) < 600


def dataclass_v(p: PeerAnnouncement, version: int) -> PeerAnnouncement:
    import dataclasses

    return dataclasses.replace(p, plan_version=version)
