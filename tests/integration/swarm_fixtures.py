"""In-process stage peers on loopback for the networking tests: real gRPC servers, no DHT."""

from __future__ import annotations

from contextlib import contextmanager

from swarm.compression import CodecConfig
from swarm.model.gpt import ModelConfig, split_layers
from swarm.net.connect import GrpcConnector
from swarm.peers.shaper import LinkShaping
from swarm.peers.transport import TransportConfig, make_server
from swarm.proto import stage_pb2_grpc
from swarm.runtime.boundary import LinkEnds
from swarm.runtime.driver import PipelineDriver
from swarm.runtime.host import StageHost, StageRole
from swarm.runtime.service import StageServicer
from swarm.runtime.worker import StageConfig

TINY = ModelConfig(vocab_size=256, seq_len_tokens=16, hidden_dim=32, n_layers=3, n_heads=2)


@contextmanager
def loopback_stages(
    n_stages: int,
    fw: CodecConfig,
    bw: CodecConfig,
    model: ModelConfig = TINY,
    shaping: LinkShaping | None = None,
    stage_cfg: StageConfig | None = None,
    **transport_kw,
):
    """Starts one gRPC stage server per stage; yields (hosts, servers, addresses). Stops them all after."""
    transport = TransportConfig(**transport_kw)
    hosts, servers, addresses = [], [], []
    try:
        for stage, (start, end) in enumerate(split_layers(model.n_layers, n_stages)):
            role = StageRole(stage, n_stages, start, end)
            links = LinkEnds(fw, bw, shaping=shaping)
            host = StageHost(role, model, stage_cfg or StageConfig(), links, f"peer{stage}", GrpcConnector(transport))
            server, port = make_server(transport)
            stage_pb2_grpc.add_StageServicer_to_server(StageServicer(host), server)
            server.start()
            hosts.append(host)
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        yield hosts, servers, addresses
    finally:
        for server in servers:
            server.stop(grace=None)
        for host in hosts:
            host.close()


def remote(addresses: list[str], schedule: str = "1f1b", n_micro: int = 2, deadline_s: float = 30.0) -> PipelineDriver:
    return PipelineDriver(
        addresses, [f"peer{i}" for i in range(len(addresses))], schedule, n_micro, deadline_s=deadline_s
    )
