"""A precision switched live by a re-plan (issue 30, QSync), for the tests of tests/integration/test_precision_*.py.

A local swarm of swarm-peer processes follows the plans of one trusted planner, the trainer's own key
(`--trusted-planners`: the plans are the test's). Plan 1 computes every stage in fp32; once stage 0 applied
`switch_after` steps, plan 2 gives the stages `precisions_after` (same layers: no handover), while the trainer runs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import swarm.train.follower as follower_module
from swarm.net.auth import Identity
from swarm.net.connect import GrpcConnector
from swarm.proto import stage_pb2
from swarm.testbed.local import local_swarm
from swarm.train.trainer import TrainConfig, train

FLAGS = ["--assign", "plan", "--compute-speed", "40", "--no-link-probe"]


def until(ready, deadline: float, what: str, stop: threading.Event | None = None):
    """Polls `ready` (a DHT read or a stage's Status) until it returns something, within the monotonic `deadline`;
    None once `stop` is set."""
    stop = stop or threading.Event()
    while not stop.is_set():
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what}")
        stop.wait(0.2)
    return None


@dataclasses.dataclass
class SwitchRun:
    plans: list[dict]
    """plan 1 and plan 2, as published"""
    summary: object
    """the trainer's summary"""
    status: list
    """the Status of every peer of plan 2's stages, stage by stage"""
    announced: dict
    """peer id -> its announcement at the end"""
    plan_version_at_start: int


def run_precision_switch(
    tmp_path,
    monkeypatch,
    n_peers: int,
    stages_of: Callable[[list[str]], list[dict]],
    precisions_after: list[str],
    steps: int,
    switch_after: int,
    extra_flags: tuple[str, ...] = (),
    **train_fields,
) -> SwitchRun:
    """Runs the trainer across the switch. `stages_of(sorted peer ids)` gives plan 1's stages."""
    planner = Identity.generate()  # the trainer's key, and the one trusted planner
    monkeypatch.setattr(Identity, "generate", classmethod(lambda cls: planner))
    plans: list[dict] = []
    found = follower_module.discover_route

    def publish_then_discover(dht, _n_stages, *args, **kwargs):
        """Plan 1 once the peers are announced, then the trainer's usual discovery (which, like the peers, reads
        plans only from this very key). Only local_swarm's call: the trainer's own discoveries on a re-plan are the
        real function's."""
        monkeypatch.setattr(follower_module, "discover_route", found)
        dht.config = dataclasses.replace(dht.config, trusted_planners=(planner.peer_id,))
        everyone = lambda: sorted(p.peer_id for p in dht.peers()) if len(dht.peers()) == n_peers else None  # noqa: E731
        stages = stages_of(until(everyone, time.monotonic() + 90, f"{n_peers} peers"))
        # as a planner that chooses precisions: the stages measure their sensitivity (PlanDocument.probe_sensitivity)
        plan = {"stages": stages, "trainer_ids": [dht.peer_id], "precisions": ["fp32"] * len(stages)}
        plans.append({**plan, "probe_sensitivity": True})
        dht.publish_plan(1, plans[0])
        return found(dht, len(stages), *args, **kwargs)

    monkeypatch.setattr(follower_module, "discover_route", publish_then_discover)
    flags = [*FLAGS, "--trusted-planners", planner.peer_id, *extra_flags]
    with local_swarm(tmp_path, n_peers, flags, timeout_s=90) as swarm:
        started_on = swarm.plan_version
        stop, errors, watcher = threading.Event(), [], GrpcConnector(signer=swarm.signer)

        def switch() -> None:
            try:
                first = plans[0]["stages"][0]["peer_ids"][0]
                address = {p.peer_id: p.address for p in swarm.dht.peers()}[first]
                stub = watcher.stage(address, first)
                steps_done = lambda: stub.Status(stage_pb2.Empty(), timeout=10).steps_done >= switch_after  # noqa: E731
                if until(steps_done, time.monotonic() + 60, f"{switch_after} steps applied", stop):
                    plans.append({**plans[0], "precisions": list(precisions_after)})
                    swarm.dht.publish_plan(2, plans[1])
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        switcher = threading.Thread(target=switch, daemon=True)
        switcher.start()
        cfg = TrainConfig(train_samples=16, batch_size=8, micro_batches=2, steps=steps, out=str(tmp_path / "train"))
        cfg = dataclasses.replace(cfg, **train_fields)
        try:
            summary = train(cfg, swarm.path, quiet=True, signer=swarm.signer, dht=swarm.dht)
        finally:
            stop.set()
            switcher.join(30)
            watcher.close()
        assert not errors and not switcher.is_alive(), errors
        announced = {p.peer_id: p for p in swarm.dht.peers()}
        connector = GrpcConnector(signer=swarm.signer)
        try:
            status = [
                connector.stage(announced[pid].address, pid).Status(stage_pb2.Empty(), timeout=10)
                for stage in plans[-1]["stages"]
                for pid in stage["peer_ids"]
            ]
        finally:
            connector.close()
    return SwitchRun(plans, summary, status, announced, started_on)
