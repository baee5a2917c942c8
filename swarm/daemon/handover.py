"""Where a peer's new host takes its state from when a plan moves it: a replica of the layers under the plan it
followed (its own host first), else a held copy, else a checkpoint; and whether a replica that kept its role sat
out steps its siblings took (then it copies them too).

A `StateHandover` is the peer daemon's (`swarm.daemon.peer.PeerDaemon`), built once its DHT node and channels are
up; it holds no state of its own between plan switches, only what it asks: the DHT's announcements, the other
stages' Status and GetState, this peer's checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from swarm.runtime.modelcheck import peer_status

__all__ = ["StateHandover"]

log = logging.getLogger("swarm.peer")


class StateHandover:
    """A plan switch's state for this peer's new host, and whether its kept host fell behind its replicas.

    Args:
        dht: the peer's DHT node (its id, the announcements, the trainers' bans).
        channels: signed channels to the other peers (their Status and GetState).
        checkpoints: this peer's checkpoints, the last source.
        stop: set when the peer stops: ends the waits for holders.
    """

    def __init__(self, dht, channels, checkpoints, stop: threading.Event):
        self.dht, self.channels, self.checkpoints, self.stop = dht, channels, checkpoints, stop

    def source(self, record, role, following):
        """The plan whose holders a new host takes its layers from: the plan this peer followed, or, for a
        peer whose first plan already makes it one more replica of a stage that others serve (its start-up
        read of the plan failed, or it restarted), `record` itself: its other replicas. None: nothing to take
        (a fresh swarm), so the layers start from the initial weights or --resume's checkpoint."""
        from swarm.daemon.replication import served_by_replicas

        if following is not None or role is None:
            return following
        return record if served_by_replicas(record, role.stage, self.dht.peers(), self.dht.peer_id) else None

    def steps_done(self, address: str) -> int | None:
        """The steps applied by the stage at `address` (its Status); None if it does not answer."""
        reply = peer_status(self.channels, address)
        return None if reply is None else int(reply.steps_done)

    def behind(self, record, role, steps_done: int, settle_s: float = 30.0) -> bool:
        """Whether another replica of this peer's stage under `record` applied more steps than this one: this
        peer sat on a route the trainer dropped (its neighbour died, or was evicted) while the others trained on,
        so its weights and optimizer are stale and must be copied again before it serves, or the replicas would
        diverge.

        A replica with a step open (the old plan's last step, run without this peer) is waited for, at most
        `settle_s`: compared before that step is applied, it would look level and the replicas would diverge
        by that step (seen when an eviction re-plans at once, while the step runs again on the survivors)."""
        others = [p for p in record.document.stages[role.stage].peer_ids if p != self.dht.peer_id]
        if not others:
            return False
        # a replica switching plans waits for nobody (it has no open step while it asks), so two replicas asking
        # each other cannot wait on each other; a replica still finishing an old-plan step is waited for
        addresses = {p.peer_id: p.address for p in self.dht.peers()}
        # a replica that does not answer has nothing to give
        deadline = time.monotonic() + settle_s
        while True:
            replies = [peer_status(self.channels, addresses[h]) for h in others if h in addresses]
            open_ = [r for r in replies if r is not None and r.step_open]
            if not open_ or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # polling a replica's open step, bounded by settle_s
        ahead = max((int(r.steps_done) for r in replies if r is not None), default=0)
        if ahead > steps_done:
            log.warning("stage %d: this replica is %d steps behind its replicas; copying their state", role.stage,
                        ahead - steps_done)  # fmt: skip
            return True
        return False

    def load(self, new_host, old, own_host=None, own: bool = True, new=None) -> None:
        """Loads the layers `new_host` takes over from the freshest copy under the old plan: a replica of the
        old stage (this peer's own host `own_host` first, unless `own` is False: it fell behind; then those plan
        `new` keeps at those layers; never a peer the run banned: `swarm.daemon.bans.trusted_sources`), else the
        held copy with the most steps, else a checkpoint."""
        from swarm.daemon.bans import announced_bans, trusted_sources
        from swarm.daemon.held import fetch_held
        from swarm.daemon.replication import takeover_sources
        from swarm.daemon.roster import retry_refused
        from swarm.daemon.state_fetch import fetch_state
        from swarm.runtime.checkpoint import checkpoint_handover, handover_tensors, take_over

        role = new_host.role
        peers = self.dht.peers()
        addresses = {p.peer_id: p.address for p in peers}
        old_stages = old.document.stages
        loaded: dict[str, torch.Tensor] = {}
        banned = announced_bans(self.dht.trainers(), new or old)  # an evicted liar still holds its stage
        for index, stage in enumerate(old_stages):
            start, end = stage.layer_start, stage.layer_end
            overlaps = start < role.layer_end and role.layer_start < end
            ends = (index == 0 and role.is_first) or (index == len(old_stages) - 1 and role.is_last)
            if not (overlaps or ends):
                continue
            replicas, held = takeover_sources(old, index, peers, self.dht.peer_id)
            replicas, held = trusted_sources(replicas, held, new, (start, end), banned)
            if not own:
                replicas = [h for h in replicas if h != self.dht.peer_id]
            replicas = self._settled(replicas, role.plan_version)
            state, why = None, []
            for holder in replicas:
                try:
                    if holder == self.dht.peer_id:
                        host = own_host
                        if host is None or (host.role.layer_start, host.role.layer_end) != (start, end):
                            continue
                        state = handover_tensors(host.worker, host.steps_done)
                    else:
                        # retried: the holder may not follow the new plan (nor serve us its state) yet
                        state = self._fetch_replica(retry_refused, fetch_state, addresses[holder], index, old.version)
                    break
                except Exception as e:
                    why.append(f"{holder}: {e}")
            for holder, steps in held if state is None else ():
                try:
                    state = fetch_held(self.channels, addresses[holder], start, end)
                    log.info("stage %d: layers [%d, %d) from %s's copy (step %d)", index, start, end, holder, steps)
                    break
                except Exception as e:
                    why.append(f"{holder}'s copy: {e}")
            if state is None:
                why_not = "; ".join(why) or "no holder left"
                state = self.checkpoints.read(index, start, end, why_not, checkpoint_handover)
                if state is None:
                    continue
            loaded.update(state)
        count, missing, steps_done = take_over(new_host.worker, loaded)
        new_host.restore(steps_done)
        lost = missing and new_host.steps_done > 0  # trained weights nobody could hand over: the run loses them
        log.log(
            logging.ERROR if lost else logging.INFO,
            "took over %d weights with their optimizer state from plan %d (step %d, lr step %d)%s",
            count,
            old.version,
            new_host.steps_done,
            new_host.worker.step_count,
            f"; {len(missing)} start from the initial weights"
            + (" (their trained state is lost: no holder answered and no checkpoint has them)" if lost else "")
            if missing
            else "",
        )

    def _settled(self, replicas: list[str], version: int, wait_s: float = 30.0) -> list[str]:
        """The live replicas to take a stage's state from (none with fewer steps than another), those that switched
        to plan `version` first.

        A holder still on the old plan may apply one more old-plan step after we copied it, and we would start
        one step behind its replicas; once it follows `version` (announced), it applies no step until this peer
        serves too. So: drop holders that do not answer Status (dead, though still announced), then wait (at
        most `wait_s`) until one of the others announces `version`; past that, take what there is.
        """
        from swarm.daemon.liveness import status_prober
        from swarm.daemon.replication import most_advanced, patient_ping

        me = self.dht.peer_id
        addresses = {p.peer_id: p.address for p in self.dht.peers()}
        ping = patient_ping(lambda t: status_prober(self.channels, lambda: addresses, timeout_s=t))
        live = [h for h in replicas if h == me or ping(h)]
        # never from a replica with fewer steps than another: it is stale (it sat out steps, or copied stale state)
        live = most_advanced(live, {h: self.steps_done(addresses[h]) for h in live if h != me and h in addresses}, me)
        others = [h for h in live if h != me]
        deadline = time.monotonic() + wait_s
        while others and time.monotonic() < deadline and not self.stop.is_set():
            switched = {p.peer_id for p in self.dht.peers() if p.plan_version >= version}
            status = {h: peer_status(self.channels, addresses.get(h, "")) for h in others if h not in switched}
            switched |= {h for h, r in status.items() if r is not None and r.plan_version >= version}  # retired
            if any(h in switched for h in others):
                return sorted(live, key=lambda h: (h != me, h not in switched))
            self.stop.wait(0.25)
        return live

    def _fetch_replica(self, retry_refused, fetch_state, address: str, stage: int, version: int) -> dict:
        """The stage's state from a replica: as it was under `version`, or (a surviving replica that moved on
        to the repaired plan with the same layers) as it is now."""
        import grpc

        try:
            return retry_refused(self.stop, fetch_state, self.channels, address, stage, version)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return retry_refused(self.stop, fetch_state, self.channels, address, stage, 0)
