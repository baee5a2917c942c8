"""In-process stage peers on loopback for the networking tests: real gRPC servers, no DHT.

Authentication is on as in a swarm: each stage has its own key, a roster of the stages and one trainer, and
`remote()` drives the stages at those addresses as that trainer (`trainer_of(addresses)`).
"""

from __future__ import annotations

from contextlib import contextmanager

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig, split_layers
from swarm.net.auth import CallSigner, CallVerifier, Identity
from swarm.net.connect import GrpcConnector
from swarm.peers.shaper import LinkShaping
from swarm.peers.transport import TransportConfig, make_server
from swarm.proto import stage_pb2_grpc
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.policy import Roster
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

TINY = ModelConfig(vocab_size=256, seq_len_tokens=16, hidden_dim=32, n_layers=3, n_heads=2)

_TRAINERS: dict[tuple[str, ...], tuple[list[str], Identity]] = {}
"""addresses of running loopback stages -> (their peer ids, the trainer's identity)"""


def trainer_of(addresses: list[str]) -> tuple[list[str], Identity | None]:
    """The peer ids of the loopback stages at `addresses` and the identity their roster names as trainer."""
    return _TRAINERS.get(tuple(addresses), ([f"peer{i}" for i in range(len(addresses))], None))


@contextmanager
def loopback_stages(
    n_stages: int,
    fw: CodecConfig,
    bw: CodecConfig,
    model: ModelConfig = TINY,
    shaping: LinkShaping | None = None,
    stage_cfg: StageConfig | None = None,
    auth: bool = True,
    run_secret: str | None = None,
    on_step=None,
    **transport_kw,
):
    """Starts one gRPC stage server per stage; yields (hosts, servers, addresses). Stops them all after.

    With `auth` every stage authenticates and authorizes calls by a roster of the stages and one trainer
    (`trainer_of(addresses)`), with `run_secret` only from holders of that secret; without `auth`, the peers
    are named peer0, peer1, ... and calls are anonymous.
    """
    transport = TransportConfig(**transport_kw)
    hosts, servers, addresses, servicers = [], [], [], []
    ids = [Identity.generate() for _ in range(n_stages + 1)] if auth else []
    peers = [i.peer_id for i in ids[:n_stages]] or [f"peer{s}" for s in range(n_stages)]
    book: dict[str, str] = {}
    try:
        for stage, (start, end) in enumerate(split_layers(model.n_layers, n_stages)):
            role = StageRole(stage, n_stages, start, end)
            links = LinkEnds(fw, bw, shaping=shaping)
            connector = GrpcConnector(transport, CallSigner(ids[stage], run_secret) if ids else None, book.get)
            host = StageHost(role, model, stage_cfg or StageConfig(), links, peers[stage], connector, on_step=on_step)
            server, port = make_server(transport)
            servicer = StageServicer(host, CallVerifier(peers[stage], run_secret) if ids else None)
            stage_pb2_grpc.add_StageServicer_to_server(servicer, server)
            server.start()
            hosts.append(host)
            servers.append(server)
            servicers.append(servicer)
            addresses.append(f"127.0.0.1:{port}")
        book.update(zip(addresses, peers, strict=True))
        roster = Roster(tuple(peers), tuple(addresses), frozenset(i.peer_id for i in ids[-1:]), frozenset(peers))
        for servicer in servicers:
            servicer.set_roster(roster)
        if ids:
            _TRAINERS[tuple(addresses)] = (peers, ids[-1])
        yield hosts, servers, addresses
    finally:
        _TRAINERS.pop(tuple(addresses), None)
        for server in servers:
            server.stop(grace=None)
        for host in hosts:
            host.close()


def remote(addresses: list[str], schedule: str = "1f1b", n_micro: int = 2, deadline_s: float = 30.0) -> PipelineDriver:
    """A driver of the loopback stages at `addresses`, as their roster's trainer."""
    peers, trainer = trainer_of(addresses)
    signer = CallSigner(trainer) if trainer is not None else None
    return PipelineDriver(addresses, peers, schedule, n_micro, deadline_s=deadline_s, signer=signer)


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (reaped by its parent's wait, not yet) is not alive."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
