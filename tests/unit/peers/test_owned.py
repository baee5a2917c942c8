"""A member's view of an owned run: it re-publishes the manifest and the newest delegation on a cadence (and
again on the next beat after a store that timed out), and keeps the newest authority when the DHT is slow."""

from __future__ import annotations

from swarm.peers.owned import OwnedRun
from tests.unit.peers.test_manifest import P2, T1, delegation, manifest


def member(read=lambda kind: [], fail: list | None = None):
    now, stored = [0.0], []

    def store(kind, subkey, text, ttl):
        if fail:
            raise fail.pop()
        stored.append((kind, subkey))
        return True

    return OwnedRun(manifest(), read, store, warn=lambda _: None, clock=lambda: now[0]), now, stored


def test_the_manifest_and_newest_delegation_are_republished_every_period_and_retried_after_a_timeout():
    run, now, stored = member(fail=[TimeoutError("slow DHT")])
    try:
        run.publish(every_s=120.0)
    except TimeoutError:
        pass
    assert run.publish(every_s=120.0) and stored == [("manifest", "manifest")], "retried on the next beat"
    now[0] = 60.0
    assert not run.publish(every_s=120.0)
    d = delegation(run.manifest, 2, planners=[P2], trainers=[T1])
    run.publish_delegation(d)
    now[0] = 200.0
    assert run.publish(every_s=120.0)
    assert stored[-2:] == [("manifest", "manifest"), ("delegations", 2)]


def test_a_slow_dht_keeps_the_last_authority():
    d = delegation(manifest(), 1, planners=[P2])
    answers: list = [[d], TimeoutError("slow")]

    def read(kind):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    run, now, _ = member(read)
    assert run.authority().planners == {P2}
    now[0] = 10.0
    assert run.authority().planners == {P2} and run.newest == d
