"""`swarm-peer`: the daemon volunteers run. It joins the swarm, takes a stage, and serves it until stopped.

Lifecycle: join the DHT -> measure compute speed -> announce -> wait for a stage assignment -> load those
layers (from a surviving replica, a held copy or a checkpoint) -> serve forward/backward over gRPC,
re-announcing on a heartbeat, keeping a copy of the buddy stage (--replicate-every) -> on SIGINT or a
`swarm stop` order: stop; on SIGTERM: leave, which hands the stage over (announce leaving, wait until the
planner's repaired plan is served without this peer or --leave-timeout-s passed) only while the run goes on
and to a peer with room for it, and is otherwise a stop (`swarm.daemon.stopping`). Stopping takes the stage out
of service between two steps and writes its final checkpoint (its own layers). Checkpoints are written
atomically, so a kill at any moment leaves the previous one intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from swarm import trace
from swarm.daemon import heapstats, memwatch
from swarm.daemon.checkpoints import StageCheckpoints
from swarm.daemon.handover import StateHandover
from swarm.daemon.lean import cap_arenas, skip_dynamo
from swarm.daemon.peer_config import PeerConfig, PlanningConfig, build_parser, config_from_args
from swarm.daemon.stopping import PeerEnding
from swarm.metrics import Metrics, MetricsServer, serve_metrics
from swarm.peers.allocator import tune_allocator
from swarm.runtime.modelcheck import check_plan_models
from swarm.startup import imports_done

if TYPE_CHECKING:
    from collections.abc import Callable

    from swarm.peers.plan import PlanDocument
    from swarm.runtime.host import StageHost

__all__ = ["PeerConfig", "PeerDaemon", "PlanningConfig", "build_parser", "config_from_args", "main"]

log = logging.getLogger("swarm.peer")


def retired(assignment, record):
    """An old host's assignment while its peer switches to `record`: its role under the new plan's version, so an
    old-plan step is refused (no step lands after its state was copied) and GetState serves it as it is now."""
    return dataclasses.replace(assignment, role=dataclasses.replace(assignment.role, plan_version=record.version))


class PeerDaemon:
    """One peer's lifetime; `run()` blocks until `stop()` (or a signal) and returns the exit code."""

    on_host: Callable[[StageHost], None] | None = None
    """told of every stage host this peer makes (a modified peer's hook, e.g. the attacks experiment's liar)"""
    on_stopped: Callable[[], None] | None = None
    """called once the stage is saved and the peer is about to close its servers and DHT node (`main` arms its
    exit watchdog there)"""

    def __init__(self, cfg: PeerConfig, on_host: Callable[[StageHost], None] | None = None):
        self.cfg = cfg
        self.on_host = on_host
        """called with every stage host this peer makes, before it serves (a test's modified volunteer)"""
        self._stop = threading.Event()
        self._leave = threading.Event()
        self._wake = threading.Event()
        """ends the plan loop's wait at once: a stop, a leave, or a call that follows a newer plan"""
        self._adopted_at = 0.0
        """when (`time.monotonic`) this peer last adopted a plan (`_settled`)"""
        self._told = False
        """a call or a ping said a plan above the followed one is out since the last whole look (`_told_newer`)"""
        self._told_woke_at = -FOLLOW_TICK_S
        """when (`time.monotonic`) such news last woke the plan loop"""
        self._leave_deadline: float | None = None
        self.ending: PeerEnding | None = None  # how it stops or leaves, once it serves
        self._announce_lock = threading.Lock()
        self.held = None  # HeldStore of the buddy copies, with --checkpoint-dir
        self.following = None  # the PlanRecord this peer serves under, in --assign plan mode
        self.checkpoints = StageCheckpoints(cfg)
        self.metrics = Metrics()
        """This process's metrics, served with --metrics-port; what the stage host should count into."""
        self.metrics_server: MetricsServer | None = None

    def _settled(self, planner) -> bool:
        """Whether this peer follows a plan it adopted over `SETTLED_AFTER_S` ago, is not leaving, and either serves
        that plan and plans nothing, or leads a swarm quiet that long (`Planner.quiet_for`), serving that plan or
        none (its standby: what it publishes, it knows of first): then nothing but a newer plan, or for the planner a
        join, a leave or a silence, changes what it does (`_look_due`)."""
        following, host = self.following, self.servicer.host
        if following is None or self._leave.is_set() or time.monotonic() - self._adopted_at < SETTLED_AFTER_S:
            return False
        if planner.leading:
            return (host is None or host.role.plan_version == following.version) and planner.quiet_for(SETTLED_AFTER_S)
        return host is not None and host.role.plan_version == following.version

    def _look_due(self, planner, woken: bool, full_at: float) -> bool:
        """Whether the plan loop takes its whole look now (the run's announcements, the planner's round, the plan):
        every `FOLLOW_TICK_S` while this peer's role may change; once `_settled`, every `SETTLED_TICK_S`, or as soon
        as a call or the planner's heartbeat said a newer plan is out (`_told_newer`). A settled peer reads nothing
        from the DHT in between: it polled the plan key twice a second, which cost about what the whole look does."""
        return woken or self._told or not self._settled(planner) or time.monotonic() >= full_at

    def _told_newer(self, version: int) -> None:
        """A call followed, or a `Ping` said (`PingRequest.newest_plan`), a plan version above the one this peer
        follows: the plan loop looks at the DHT at its next tick, and is woken for it at most once a
        `FOLLOW_TICK_S`. Anyone may say it: what is adopted is what the DHT's signed records say, so a liar's news
        costs no more looks than an unsettled peer takes anyway."""
        following = self.following
        if following is not None and version <= following.version:
            return
        self._told = True
        now = time.monotonic()
        if now - self._told_woke_at >= FOLLOW_TICK_S:
            self._told_woke_at = now
            self._wake.set()

    def _pause(self) -> bool:
        """Waits `FOLLOW_TICK_S` for the plan loop's next look; whether something woke it sooner (`_wake`)."""
        woken = self._wake.wait(FOLLOW_TICK_S)
        self._wake.clear()
        return woken

    def stop(self, *_):
        """Stop (SIGINT): checkpoint this stage and exit; a second SIGINT interrupts at once."""
        if self._stop.is_set():
            raise KeyboardInterrupt
        self._stop.set()
        self._wake.set()

    def leave(self, *_):
        """Graceful leave (SIGTERM): hand the stage over, then stop; a second SIGTERM stops at once."""
        if self._leave.is_set() or self.cfg.assign != "plan":
            self._stop.set()
        self._leave.set()
        self._wake.set()

    def run(self) -> int:
        from swarm.daemon.addresses import stage_address, stage_announce_host
        from swarm.daemon.capacity import measure_compute, measure_speeds, memory_bytes
        from swarm.daemon.nat import NatWiring
        from swarm.daemon.roster import AddressBook, PeerAuth, delegated_trainers
        from swarm.net.connect import SignedChannels
        from swarm.peers.dht import SwarmDHT
        from swarm.peers.reannounce import Reannouncer
        from swarm.peers.records import PeerAnnouncement
        from swarm.peers.shaper import LinkShaping
        from swarm.peers.transport import Channels, make_server
        from swarm.proto import stage_pb2_grpc
        from swarm.runtime.device import compute_key
        from swarm.runtime.service import StageServicer

        cfg = self.cfg
        if cfg.cpus is not None:  # before the DHT's process and p2pd start: they inherit it
            from swarm.runtime.device import pin_cpus

            pin_cpus(cfg.cpus)
        torch.set_num_threads(cfg.threads)
        trace.start(f"peer {os.getpid()}")  # where SWARM_TRACE_DIR asks for a timeline
        if cfg.fw_codec.buffer_dir:  # before anything starts: another peer on this directory would share its buffers
            from swarm.compression.buffers import BufferDirInUse, lock_buffer_dir

            try:
                lock_buffer_dir(cfg.fw_codec.buffer_dir)
            except BufferDirInUse as e:
                log.error("%s", e)
                return 2
        self.model = cfg.model
        self.codecs = (cfg.fw_codec, cfg.bw_codec)
        self.shaping = LinkShaping(cfg.link_shape, dict(cfg.link_shapes))
        auth = PeerAuth.load(cfg.dht)  # one key signs the DHT records and the calls: its hash is the peer id
        dht = SwarmDHT(cfg.dht, private_key=auth.identity.key)
        self.dht, self.signer = dht, auth.signer  # the stages serve only the trainers the owner delegates now
        self.book = AddressBook(dht, auth.allowed_trainers, delegated=lambda: delegated_trainers(dht))
        self.nat = NatWiring(self, cfg.reach, cfg.relay, self.signer, auth.verifier() if cfg.auth else None)
        server = None
        try:
            # the gRPC and metrics servers start after the DHT's process is forked: forking beside gRPC threads
            # is unsafe, and the DHT's process would hold a copy of the metrics port's listening socket
            if cfg.metrics_port is not None:
                try:
                    self.metrics_server = serve_metrics(self.metrics, cfg.metrics_port, cfg.transport.host)
                except OSError as e:
                    log.error("cannot serve metrics on %s:%d: %s", cfg.transport.host, cfg.metrics_port, e)
                    return 2
                log.info("metrics at %s", self.metrics_server.url)
            self.transport = cfg.transport
            self.channels = SignedChannels(Channels(self.transport, self.nat.tunnels.dial), self.signer, self.book)
            self.handover = StateHandover(self.dht, self.channels, self.checkpoints, self._stop)
            server, port = make_server(self.nat.server_transport(self.transport), cfg.grpc_port)
            try:
                address = stage_address(stage_announce_host(cfg.transport.host, cfg.announce_host), port)
            except ValueError as e:
                log.error("%s", e)
                return 2
            self.servicer = StageServicer(None, auth.verifier() if cfg.auth else None, budget=cfg.budget)
            self.servicer.state_sent = self.metrics.state_bytes.inc
            self.servicer.on_newer_plan = self._told_newer  # a call on a newer plan, or the planner's heartbeat
            if cfg.checkpoint_dir:
                from pathlib import Path

                from swarm.daemon.held import HeldStore
                from swarm.daemon.replication import HeldServer

                self.held = HeldStore(Path(cfg.checkpoint_dir) / "held")
                self.servicer.held_state = HeldServer(self.held, self.model.n_layers)
            stage_pb2_grpc.add_StageServicer_to_server(self.servicer, server)
            # Relay: dial-back, Echo, and relaying for peers behind NAT (bytes on the data port)
            self.nat.add_to(server, cfg.transport.host, cfg.relay_data_port)
            server.start()
            log.info("stage service listening on %s", address)
            self.mb = cfg.planning.micro_batch_size
            self.speed = cfg.compute_layers_per_s or measure_compute(self.model, cfg.device, micro_batch_size=self.mb)
            self.speed /= cfg.compute_slowdown  # an experiment's slower device (swarm.runtime.throttle)
            log.info("joined the DHT as %s; compute %.1f layers/s on %s", dht.peer_id, self.speed, cfg.device)
            if dht.manifest is None and not cfg.dht.trusted_planners:
                log.warning(
                    "this run is unowned: any peer can take over its planning (the lowest id holding a lease plans, "
                    "and ids can be ground) and name any trainer; for a run volunteers can trust, start it with "
                    "`swarm run init` and join it with --run ID"
                )
            self.announcement = PeerAnnouncement(
                peer_id=dht.peer_id,
                address=address,
                device=cfg.device,
                memory_bytes=memory_bytes(),
                compute_layers_per_s=self.speed,
                speeds=()
                if cfg.compute_layers_per_s
                else tuple((p, v / cfg.compute_slowdown) for p, v in measure_speeds(self.model, cfg.device, self.mb)),
                started_at=time.time(),
                codec=self.codecs[0].label,
                held=self.held.held() if self.held is not None else (),
                compute_key=compute_key(cfg.device, cfg.cpus, cfg.compute_group),
            )
            # follow the current plan before announcing: this peer may become the planner, and its first plan
            # then takes the layers over from this plan's holders
            with contextlib.suppress(TimeoutError):
                if cfg.assign == "plan" and (record := dht.get_plan(self.model.n_layers)):
                    self._apply_plan(record)
            reannouncer = Reannouncer(dht, lambda: self.announcement, lock=self._announce_lock).start()  # announces now
            self.ending = PeerEnding(
                cfg, dht, self.servicer, self.checkpoints, self._stop, self.announcement.started_at
            )
            if self.nat.settle(cfg.transport.host, port, stop=self._stop) == "direct" and cfg.reach == "auto":
                self.nat.serve_dht_records()  # joined as a client until found dialable (swarm.net.dhtmode)
            log.info("links shaped to %s", cfg.link_shape.describe())
            code = self._follow_plans(address) if cfg.assign == "plan" else self._serve_even_split()
            if code:
                return code
            # others must not wait for this peer (a leaving neighbour waits for a plan without it while any peer
            # it could hand over to looks staying; an exited peer's announcement would look so for its TTL)
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.update_announcement(leaving=True)
            host = self.ending.retire()
            server.stop(grace=5).wait(10)
            if host is not None:
                with host.compute_lock:
                    self.ending.save_final(host)
            reannouncer.stop(timeout_s=3.0)  # a refresh stuck on a DHT node that stopped first is left behind
            log.info("stopped")
            if self.on_stopped is not None:
                self.on_stopped()
            return 0
        finally:
            trace.flush()  # here, not only at exit: a peer whose exit hangs is ended without atexit
            if server is not None:
                server.stop(grace=None)
            if self.metrics_server is not None:
                self.metrics_server.close()
            self.nat.close()
            dht.shutdown()

    # ---- roles ---------------------------------------------------------------------------------------------

    def _epilogue_only(self, plan: PlanDocument | None):
        """The backward sends' epilogue-only compression: the plan's choice (--plan-epilogue-only), else this peer's
        own --bw-epilogue (None: every message at the backward codec)."""
        from swarm.runtime.boundary import EpilogueOnly

        return EpilogueOnly.parse((plan.bw_epilogue if plan is not None else None) or self.cfg.bw_epilogue)

    def _make_host(self, role, plan: PlanDocument | None = None):
        from swarm.net.connect import GrpcConnector
        from swarm.runtime.boundary import LinkEnds
        from swarm.runtime.freeze import apply_frozen
        from swarm.runtime.host import StageHost
        from swarm.runtime.throttle import ComputeThrottle
        from swarm.runtime.worker import StageConfig

        cfg = self.cfg
        # a plan's per-link codecs (over this peer's own codec options), else the flags'
        ends = plan.link_configs(role.stage, self.codecs) if plan is not None else self.codecs * 2
        precision = plan.precision(role.stage, cfg.precision) if plan is not None else cfg.precision
        host = StageHost(
            role,
            self.model,
            StageConfig(cfg.optim, precision=precision, device=cfg.device),
            LinkEnds(
                ends[0],
                ends[1],
                shaping=self.shaping,
                recv=(ends[2], ends[3]),
                epilogue=self._epilogue_only(plan),
            ),
            peer_id=self.dht.peer_id,
            connector=GrpcConnector(self.transport, self.signer, self.book, self.nat.tunnels.dial),
            metrics=self.metrics,
            budget=cfg.budget,
            on_step=self.checkpoints.on_step,
        )
        epilogue = plan.epilogue_configs(role.stage) if plan is not None else (None, None)
        host.apply(  # the plan's link codecs and averaging/tied codecs, this peer's measured speed
            dataclasses.replace(host.assignment, link_codecs=ends, compute_layers_per_s=self.speed, epilogue=epilogue)
        )
        apply_frozen(host, plan.frozen if plan is not None else 0)  # a repacked plan's frozen prefix: never trained
        self._probe_as_asked(host.worker, plan)
        if cfg.compute_slowdown > 1:
            ComputeThrottle(host.worker, cfg.compute_slowdown)
        self.checkpoints.setup(host)
        if self.on_host is not None:
            self.on_host(host)
        return host

    def _probe_as_asked(self, worker, plan: PlanDocument | None) -> None:
        """Gives `worker` a sensitivity probe where `plan` asks for one (`PlanDocument.probe_sensitivity`: its planner
        chooses precisions from the stages' own figures, announced by `sensitivity_report`) and this peer measures
        (--sensitivity-every-steps), and takes it away where not: each probe runs two more passes of a micro-batch
        on the step's critical path (a 2-stage CPU step 35-60% longer), for a figure only such a planner reads.
        A probe kept across plans keeps its figures."""
        from swarm.runtime.sensitivity_probe import ProbeConfig, SensitivityProbe

        every = self.cfg.sensitivity_every_steps
        if not every or plan is None or not plan.probe_sensitivity:
            worker.probe = None
        elif worker.probe is None:
            worker.probe = SensitivityProbe(ProbeConfig(every_steps=every), torch.device(self.cfg.device).type)

    def update_announcement(self, **changes):
        """Changes these fields of this peer's announcement and announces it. Threads change different fields (the
        plan loop its role, the relay's its reach): each change is made on the newest announcement under one
        lock, announced under it too, so none writes back another's field as it was before (a stale relay sends
        callers to a relay this peer left) and no older record reaches the DHT after a newer one."""
        with self._announce_lock:
            self.announcement = announced = dataclasses.replace(self.announcement, **changes)
            self.dht.announce(announced)
        return announced

    def _announce_role(self, role) -> None:
        announced = self.update_announcement(
            stage=None if role is None else role.stage,
            layer_start=None if role is None else role.layer_start,
            layer_end=None if role is None else role.layer_end,
            plan_version=self.following.version if self.following is not None else 0,
        )
        self.metrics.plan_version.set(announced.plan_version)

    def _serve_even_split(self) -> int:
        from swarm.daemon.assign import EvenSplit

        assigner = EvenSplit(self.cfg.num_stages, self.model.n_layers, self.cfg.stage)
        role = self._wait_for_role(self.dht, assigner)
        if role is None:
            if self._stop.is_set():
                return 0
            log.error("no stage assigned within %.0f s; leaving", self.cfg.assign_timeout_s)
            return 3
        log.info("serving stage %d of %d: layers [%d, %d)", role.stage, role.n_stages, role.layer_start, role.layer_end)
        self.servicer.host = self._make_host(role)
        self.servicer.roster_source = lambda: self.book.even_roster(role.n_stages)
        self._announce_role(role)
        log.info("ready")
        while not self._stop.wait(1.0) and not self.ending.ordered():  # the split's peers announce one by one
            self.servicer.set_roster(self.book.even_roster(role.n_stages) or self.servicer.policy.roster)
        return 0

    def _follow_plans(self, address: str) -> int:
        """Probes links, plans when this peer leads, and serves whatever the newest plan gives it."""
        from swarm.daemon.calibrate import calibrator, status_reader
        from swarm.daemon.liveness import Liveness, LivenessConfig, adaptive_trips, status_prober
        from swarm.daemon.planning import Planner
        from swarm.daemon.probe import LinkProber
        from swarm.daemon.repack import RepackWatch
        from swarm.daemon.sensitivity_report import SensitivityReport
        from swarm.scheduler.bits import epilogue_codec_speed, flags_policy, measured_link_ladder
        from swarm.scheduler.epilogue_only import epilogue_only_planner
        from swarm.scheduler.precision_choice import precision_planner
        from swarm.scheduler.sizes import model_spec

        cfg, plans = self.cfg, self.cfg.planning
        spec = model_spec(self.model, *self.codecs, plans.micro_batch_size, plans.micro_batches)
        # per-link: the flags' codecs are the floors (the most compression a link may get), and the search places
        # peers knowing each link's codec (bits.link_ladder); flags off the ladders keep their codecs on every link
        bits = flags_policy(*self.codecs) if plans.codec_policy == "per-link" else None
        if bits is not None:
            spec = dataclasses.replace(spec, link_ladder=measured_link_ladder(self.model, plans.micro_batch_size, bits))
        elif plans.codec_policy == "per-link":
            labels = "/".join(c.label for c in self.codecs)
            log.warning("per-link codecs: %s is not on the ladders (bits.FORWARD_LADDER, BACKWARD_LADDER): every link "
                        "keeps it; the sums' and tied sync's codecs are still chosen", labels)  # fmt: skip
        stages = cfg.num_stages or None
        # --no-link-probe: no measurement, every link planned at the default; no probe wait for the planner
        prober = None
        if plans.probe_links:
            prober = LinkProber(
                self.dht,
                address,
                self.shaping,
                self.channels,
                probe_bytes=plans.probe_bytes,
                peers_per_round=plans.peers_per_round,
                refresh_s=plans.refresh_s,
            )
        self._addresses: dict[str, str] = {}
        liveness = Liveness(
            status_prober(
                self.channels,
                lambda: self._addresses,
                trips=adaptive_trips(plans.heartbeat_s),
                newest_plan=lambda: self.dht.published_plan,  # a settled peer looks at the DHT when told
            ),
            LivenessConfig(every_s=plans.heartbeat_s, gone_after_s=plans.gone_after_s),
            heard=self.servicer.heard_from,  # a plan peer calling this one (its activations, say) is alive
        )
        planner = Planner(
            plans,
            self.dht,
            spec,
            stages,
            liveness=liveness,
            epilogue=plans.codec_policy != "fixed",
            bits=bits,
            codec_speed=epilogue_codec_speed() if plans.codec_policy != "fixed" else None,
            epilogue_only=epilogue_only_planner(self.model, self.codecs, plans) if plans.epilogue_only else None,
            reannounce=self.update_announcement,  # SwarmDHT stamps the lease on it
            calibrator=calibrator(plans, self.channels, lambda: self._addresses),
            repack=RepackWatch(status_reader(self.channels, lambda: self._addresses)) if plans.repack else None,
            precisions=precision_planner(self.model, plans.precision_budget, plans.micro_batch_size),
        )
        lease_stop = threading.Event()
        threading.Thread(target=planner.keep_lease, args=(lease_stop,), name="swarm-planner-lease", daemon=True).start()
        replicator = self._replicator()
        deadline = time.monotonic() + cfg.assign_timeout_s
        sensitivity = SensitivityReport()
        next_probe, traced_leave, full_at, woken = 0.0, False, 0.0, False
        try:
            while not self._stop.is_set():
                try:
                    if not self._look_due(planner, woken, full_at):
                        if self.ending.ordered():
                            return 0
                        # a settled planner's heartbeats go on between its looks; a new silence is looked at now
                        woken = planner.beat() or self._pause()
                        continue
                    full_at, self._told = time.monotonic() + SETTLED_TICK_S, False
                    peers = self.dht.peers()
                    self._addresses = {p.peer_id: p.address for p in peers}
                    if prober is not None and time.monotonic() >= next_probe:
                        # probe often while peers are new to us, then only to refresh
                        soon = prober.round() or not prober.found_peers  # nobody to probe yet: look again soon
                        next_probe = time.monotonic() + (1.0 if soon else plans.interval_s)
                        peers = self.dht.peers()  # a probe takes a while: look again
                    # a tick's DHT requests are few: each is a search whose records are all checked (signatures),
                    # every peer polls twice a second, and a tick once read the announcements three times and the
                    # trainers' once more (5 requests; now 2 unless a newer plan is out)
                    planner.round(peers)
                    followed = self.following.version if self.following is not None else 0
                    record = self.dht.get_plan(self.model.n_layers, peers=peers, newer_than=followed)
                    if record is not None:
                        self._apply_plan(record)
                    elif self.following is not None and (
                        self.servicer.policy.roster is None or self.book.delegation_changed()
                    ):  # no roster yet, or the owner revoked (or delegated) a trainer: the stage serves the new set
                        self.servicer.set_roster(self.book.plan_roster(self.following, self.announcement))
                    if replicator is not None and not self._leave.is_set():
                        replicator.tick(self.following, peers)
                    if (measured := sensitivity.entries(self.servicer.host)) is not None:
                        self.update_announcement(sensitivity=measured)
                    if self._leave.is_set() and not traced_leave:  # a leave may outlast its testbed's patience:
                        traced_leave = trace.flush() is not None  # the spans so far are written when it begins
                    if self.ending.ordered() or (self._leave.is_set() and self._left(peers, spec)):
                        return 0
                except TimeoutError as e:  # a slow DHT request: try again next tick
                    log.warning("%s", e)
                if self.servicer.host is None and self.following is None and time.monotonic() > deadline:
                    log.error("no plan gave this peer a stage within %.0f s; leaving", cfg.assign_timeout_s)
                    return 3
                woken = self._pause()
        finally:
            lease_stop.set()
            liveness.close()
            if replicator is not None:
                replicator.close()
        return 0

    def _left(self, peers, spec) -> bool:
        """After SIGTERM: announces leaving once, if the stage can be handed over (else it stops at once); True
        when the successor serves this peer's layers (or the leave timed out, or there was nothing to hand
        over)."""
        from swarm.daemon.replication import leave_done

        held = self.servicer.host or self.servicer.previous
        if self._leave_deadline is None:
            blocker = self.ending.leave_blocker(held, peers, spec)
            if blocker is not None:
                log.info("leaving without handing the stage over (%s): checkpointing and exiting", blocker)
                return True
            self._leave_deadline = time.monotonic() + self.cfg.leave_timeout_s
            self.update_announcement(leaving=True)
            log.info("leaving: waiting for a plan without this peer (at most %.0f s)", self.cfg.leave_timeout_s)
        if held is None:
            return True
        if self.ending.taker(held, peers, spec) is None:  # the peer that had room is leaving too, or gone
            log.info("leave abandoned (no peer that stays has room for this stage): checkpointing and exiting")
            return True
        layers = (held.role.layer_start, held.role.layer_end)
        if leave_done(self.following, peers, self.dht.peer_id, layers):
            log.info("left: plan %d serves layers [%d, %d) without this peer", self.following.version, *layers)
            return True
        if time.monotonic() > self._leave_deadline:
            log.warning("leave timed out after %.0f s: stopping anyway", self.cfg.leave_timeout_s)
            return True
        return False

    def _replicator(self):
        """Keeps a copy of the buddy stage under --checkpoint-dir/held (None without a checkpoint dir)."""
        from swarm.daemon.replication import Replicator, copy_rate, copy_timeout_s
        from swarm.daemon.state_fetch import fetch_state

        if self.held is None:
            return None

        def fetch(address: str, stage: int, version: int) -> dict:
            # paced at a share of the measured link (on a slow one an unpaced copy starves the run's calls and the
            # DHT's packets for a minute), with a deadline that allows for the pace
            holder = next((p.peer_id for p in self.dht.peers() if p.address == address), None)
            rate = copy_rate(self.dht.links(), holder, self.dht.peer_id)
            host = self.servicer.host
            own = 12 * sum(p.numel() for p in host.worker.module.parameters()) if host is not None else 0
            timeout_s = copy_timeout_s(max(own, 1 << 20), rate)
            return fetch_state(
                self.channels,
                address,
                stage,
                version,
                timeout_s=timeout_s,
                max_bytes_per_s=rate,
                on_call=replicator.track,
            )

        def announce_held() -> None:
            self.update_announcement(held=self.held.held())

        replicator = Replicator(self.dht.peer_id, self.held, self.cfg.replicate_every, self.handover.steps_done, fetch)
        replicator.on_pulled = announce_held
        return replicator

    def _apply_plan(self, record) -> None:
        """Switches to this peer's role under `record`, between two steps, with its layers handed over."""
        from swarm.daemon.planning import role_in_plan
        from swarm.runtime.sensitivity import set_stage_precision

        role = role_in_plan(record, self.dht.peer_id)
        plan = record.document
        roster = self.book.plan_roster(record, self.announcement)
        host = self.servicer.host
        same = (
            host is not None
            and role is not None
            and (host.role.stage, host.role.n_stages, host.role.layer_start, host.role.layer_end)
            == (role.stage, role.n_stages, role.layer_start, role.layer_end)
            and plan.link_configs(role.stage, self.codecs) == host.assignment.link_codecs
            # the plan's epilogue-only choice changed (calibrated): the link ends are built anew
            and self._epilogue_only(plan) == host.links.epilogue
        )
        wait_s = 2 * 120.0
        behind = same and self.following is not None and self.handover.behind(record, role, host.steps_done)
        if same and not behind:

            def bump(servicer) -> None:
                set_stage_precision(servicer.host.worker, plan.precision(role.stage, self.cfg.precision))
                self._probe_as_asked(servicer.host.worker, plan)
                # same layers: only the plan version (epilogue codecs, precision) change
                epilogue = plan.epilogue_configs(role.stage)
                servicer.host.apply(dataclasses.replace(servicer.host.assignment, role=role, epilogue=epilogue))
                servicer.set_roster(roster)

            self.servicer.when_idle(bump, wait_s)
        else:
            new_host = None if role is None else self._make_host(role, plan)
            source = self.handover.source(record, role, self.following)
            if new_host is not None and source is not None and self.servicer.host is not None:
                # the old host takes no further old-plan step (it is refused: the trainer follows the new plan)
                # while its state is copied, here and by the peers that take its layers (GetState "now")
                self.servicer.when_idle(lambda sv: sv.host.apply(retired(sv.host.assignment, record)), wait_s)
            if new_host is not None and source is not None:
                own = not behind and source is self.following
                self.handover.load(new_host, source, self.servicer.host, own=own, new=record)
            self.servicer.swap(new_host, wait_s, plan_version=record.version, roster=roster)
            if roster is None:
                self.servicer.set_roster(None)  # no calls until every stage's address is known
        previous = self.following.version if self.following is not None else 0
        if role is not None:  # off the plan-switch path: says which plan peer serves another model, by name
            check_plan_models(self.channels, record, self.dht.peers, self.dht.peer_id, self.servicer.host)
        self.following = record
        self._adopted_at = time.monotonic()
        self._announce_role(role)
        if role is None:
            log.info("plan %d (was %d) leaves this peer on standby", record.version, previous)
        else:
            log.info(
                "plan %d (was %d): serving stage %d of %d, layers [%d, %d)",
                record.version,
                previous,
                role.stage,
                role.n_stages,
                role.layer_start,
                role.layer_end,
            )

    def _wait_for_role(self, dht, assigner):
        deadline = time.monotonic() + self.cfg.assign_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            role = assigner.assign(dht.peers(), dht.peer_id)
            if role is not None:
                return role
            self._stop.wait(0.5)
        return None


def main(argv: list[str] | None = None, on_host: Callable[[StageHost], None] | None = None) -> int:
    """swarm-peer; `on_host` (see `PeerDaemon`) is for programs that run a modified peer, never set by the CLI."""
    imports_done()  # every module is in: the collector on again, what the imports made frozen (swarm.startup)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    tune_allocator()
    cap_arenas()  # before the threads: 2 malloc arenas, not 8 per core
    skip_dynamo()  # a peer compiles nothing: no torch._dynamo, sympy, triton (~150 MB)
    memwatch.start_from_env()  # SWARM_MEMWATCH_S: what grows (a soak's diagnostic)
    heapstats.start_from_env()  # SWARM_HEAPSTATS_S: glibc's in-use and free bytes (a soak's diagnostic)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    daemon = PeerDaemon(cfg, on_host)
    signal.signal(signal.SIGINT, daemon.stop)
    signal.signal(signal.SIGTERM, daemon.leave)
    daemon.on_stopped = lambda: _exit_within(EXIT_GRACE_S, 0)
    try:
        return daemon.run()
    except KeyboardInterrupt:  # a second SIGINT: out at once, the last periodic checkpoint stands
        log.warning("interrupted: stopped without a final checkpoint")
        return 130


FOLLOW_TICK_S = 0.5
"""The plan loop's look at the DHT (announcements, plans, the planner's round) while this peer's role may change."""
SETTLED_TICK_S = 2.0
"""... once it serves the plan it follows and plans nothing, or plans a swarm quiet for `SETTLED_AFTER_S`
(`PeerDaemon._settled`; such a planner's heartbeats go on every second between looks, and a silence they find is
looked at at once; a join waits for the next look): each whole look is DHT searches
whose every record is checked (RSA signatures) and which every other peer's DHT node serves, so an idle 5-peer swarm
looking twice a second took 56-70% of a core (`swarm bench idle`, s61). In between it learns of a new plan from the
elected planner's heartbeats, which say the newest version it published (`PingRequest.newest_plan`) and go out at
once after a publish, and from calls that follow it; a lost heartbeat is said again a round later, and a planner
that says nothing (an older one) leaves the whole look every `SETTLED_TICK_S`."""
SETTLED_AFTER_S = 10.0
"""How long after adopting a plan a peer still looks every `FOLLOW_TICK_S`: a replan's stragglers and calibrations
come in bursts."""

EXIT_GRACE_S = 10.0
"""How long a stopped peer may take to close its servers and DHT node and exit before it is ended (its stage is
saved by then)."""


HARD_EXIT_AFTER_S = 5.0
"""How long after `EXIT_GRACE_S` a peer whose exit timer could not run is ended by faulthandler's watchdog."""


def _exit_within(grace_s: float, code: int) -> None:
    """Ends the process with `code` if it has not exited `grace_s` after the peer stopped, naming the threads that
    held it (a closing step that waits on a peer or DHT node that stopped first, or a thread joined at exit).

    The timer is a Python thread: it cannot run while another thread holds the GIL in native code, nor once the
    interpreter is finalizing (daemon threads then never get the GIL back), which is where a peer's exit can
    hang (gRPC's and the DHT's native teardown). So faulthandler's watchdog, a native thread that needs no GIL,
    ends the process `HARD_EXIT_AFTER_S` later all the same, with every thread's stack and exit status 1."""
    import faulthandler

    faulthandler.dump_traceback_later(grace_s + HARD_EXIT_AFTER_S, exit=True, file=sys.stdout)

    def end() -> None:
        log.warning("still running %.0f s after stopping; the threads that hold the exit:", grace_s)
        sys.stdout.flush()
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(code)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    sys.exit(main())
