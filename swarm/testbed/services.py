"""The testbed as data: its config, its services and their argv, the one list both testbeds run.

A frozen `TestbedConfig` gives the services (`testbed_services`): a DHT bootstrap node, one swarm-peer per
stage and a trainer, each with its address in a private subnet, its argv for an installed entry point and
its egress rates. The namespace testbed (`swarm.testbed.netns`) and docker compose
(`swarm.testbed.compose`) run exactly these.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from swarm.flags import flag

if TYPE_CHECKING:
    from swarm.daemon.peer_config import PeerConfig

__all__ = [
    "ADDRESS_FILE",
    "METRICS_PORT",
    "metrics_port",
    "nat_lan",
    "nat_names",
    "BOOTSTRAP_PORT",
    "PEER_PORT",
    "LinkRate",
    "Service",
    "TestbedConfig",
    "process_argv",
    "service_addresses",
    "testbed_services",
]

BOOTSTRAP_PORT = 31337
"""DHT port of the bootstrap node: fixed (each namespace or container has its own ports), so with its
identity file its multiaddr survives a restart."""
PEER_PORT = 50051
"""gRPC port of every peer's stage service: fixed, so per-link delays can name `ADDR:PORT` up front."""
METRICS_PORT = 9400
"""Port of every peer's and the trainer's /metrics (each at its own address)."""
ADDRESS_FILE = "bootstrap.addr"
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,5}-")
_NAME_RE = re.compile(r"bootstrap|trainer|peer\d+")


_NETWORK = "network (bandwidth by the kernel, delay by swarm-peer's shaper)"


@dataclass(frozen=True)
class LinkRate:
    """One directed link shaped differently from its sender's default."""

    src: str
    """Sending service: bootstrap, trainer or peerI."""
    dst: str
    """Receiving service."""
    rate_mbit: float | None = None
    """Bandwidth of this link, Mbit/s (kernel, an htb class on the sender's egress); None keeps the default."""
    delay_ms: float = field(default=0.0, metadata=flag(group=_NETWORK))
    """One-way delay of this link, ms (the sending peer's application shaper); peers at both ends only."""

    def __post_init__(self) -> None:
        for end in (self.src, self.dst):
            if not _NAME_RE.fullmatch(end):
                raise ValueError(f"LinkRate: {end!r} is not a service (bootstrap, trainer, peerI)")
        if self.src == self.dst:
            raise ValueError(f"LinkRate: {self.src} -> {self.dst} is not a link")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"LinkRate.rate_mbit: expected > 0, got {self.rate_mbit}")
        if self.delay_ms < 0:
            raise ValueError(f"LinkRate.delay_ms: expected >= 0, got {self.delay_ms}")
        if self.delay_ms and not (self.src.startswith("peer") and self.dst.startswith("peer")):
            raise ValueError(f"LinkRate {self.src}:{self.dst}: a per-link delay needs peers at both ends")

    @classmethod
    def parse(cls, text: str) -> LinkRate:
        """`SRC:DST=RATE[:DELAY]`, e.g. `peer0:peer1=10:40`; RATE `none` keeps the sender's default rate."""
        ends, sep, shape = text.partition("=")
        src, colon, dst = ends.partition(":")
        if not sep or not colon:
            raise ValueError(f"link {text!r}: expected SRC:DST=RATE[:DELAY], e.g. peer0:peer1=10:40")
        rate, _, delay = shape.partition(":")
        rate_mbit = None if rate.strip().lower() in ("", "none") else float(rate)
        return cls(src.strip(), dst.strip(), rate_mbit, float(delay) if delay else 0.0)

    def text(self) -> str:
        """The `SRC:DST=RATE[:DELAY]` that parses back to this link."""
        rate = "none" if self.rate_mbit is None else repr(self.rate_mbit)
        return f"{self.src}:{self.dst}={rate}" + (f":{self.delay_ms!r}" if self.delay_ms else "")


def _numbers(kind: type) -> Callable[[str], tuple]:
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def _joined(values: tuple) -> str:
    return ",".join(map(repr, values)) if values and isinstance(values[0], float) else ",".join(map(str, values))


@dataclass(frozen=True)
class Egress:
    """Bandwidth by the kernel: the `--rate-mbit` of the commands that shape with tc (`swarm testbed up`,
    `compose` and `shape`), as opposed to a peer's own shaper in the application (`swarm.options.LinkShaping`)."""

    rate_mbit: float = 100.0
    """tc egress of every namespace, Mbit/s; 0 leaves it unshaped"""

    def __post_init__(self) -> None:
        if self.rate_mbit < 0:
            raise ValueError(f"--rate-mbit: expected >= 0 (0: unshaped), got {self.rate_mbit}")


@dataclass(frozen=True)
class TestbedConfig:
    """A testbed: one DHT bootstrap node, `peers` swarm-peers and a trainer, each in its own namespace."""

    peers: int = field(default=2, metadata=flag(group="swarm"))
    """swarm-peer services, one pipeline stage each."""
    egress: Egress = field(default_factory=Egress, metadata=flag(group=_NETWORK))
    """Every namespace's egress (peers: unless `peer_rate_mbit` says otherwise)."""
    peer_rate_mbit: tuple[float, ...] = field(
        default=(),
        metadata=flag(
            parse=_numbers(float),
            render=_joined,
            metavar="R0,R1,...",
            group=_NETWORK,
        ),
    )
    """Egress bandwidth of peer i (entry i, 0 = unshaped); peers past the end get `--rate-mbit`."""
    links: tuple[LinkRate, ...] = field(
        default=(),
        metadata=flag(
            name="--link", repeat=True, parse=LinkRate.parse, render=LinkRate.text, metavar="SRC:DST=RATE[:DELAY]",
            group=_NETWORK,
        ),
    )  # fmt: skip
    """Directed links shaped differently from their sender's default."""
    delay_ms: float = 0.0
    """One-way delay of every peer's outgoing links, ms, applied by swarm-peer's application shaper."""
    subnet: str = field(default="10.77.0.0/24", metadata=flag(group=_NETWORK))
    """Private IPv4 subnet of the bridge; bootstrap .2, trainer .3, peer i .(10+i) (Docker's gateway is .1)."""
    prefix: str = field(default="swt-", metadata=flag(skip=True))
    """Start of every namespace and link name, so `down` finds leftovers; 2-7 characters ending in '-'."""
    fw_codec: str = field(default="acsgd2+ch+nr+fsl32+fslw4+fsle10+dsl16+s20", metadata=flag(group="swarm"))
    """Activation codec of the peers (swarm.compression.DEFAULT_FORWARD_CODEC, spelled out: this module stays free of
    torch; a test checks they agree)."""
    bw_codec: str = field(default="gradq2+rot+nr+cs+g256", metadata=flag(group="swarm"))
    """Gradient codec of the peers (swarm.compression.DEFAULT_BACKWARD_CODEC)."""
    model: str | None = field(default=None, metadata=flag(group="swarm"))
    """`--model` of every peer and the trainer: a preset name (None: the entry points' default, the built-in)."""
    layers: int | None = field(default=None, metadata=flag(group="swarm"))
    """Transformer blocks (None: the entry points' default; likewise hidden, heads, seq_len)."""
    hidden: int | None = field(default=None, metadata=flag(group="swarm"))
    """Width of the residual stream (None: the entry points' default)."""
    heads: int | None = field(default=None, metadata=flag(group="swarm"))
    """Attention heads (None: the entry points' default)."""
    seq_len: int | None = field(default=None, metadata=flag(group="swarm"))
    """Tokens per sample (None: the entry points' default)."""
    epochs: int = field(default=4, metadata=flag(group="swarm"))
    """Passes of the trainer over its samples (ignored when `steps` is set)."""
    steps: int | None = field(default=None, metadata=flag(group="swarm"))
    """Optimizer steps of the trainer; None: `epochs` worth."""
    train_samples: int = field(default=64, metadata=flag(group="swarm"))
    """Training samples."""
    batch_size: int = field(default=8, metadata=flag(group="swarm"))
    """Samples per optimizer step."""
    micro_batches: int = field(default=4, metadata=flag(group="swarm"))
    """Micro-batches per step."""
    peer_flags: tuple[str, ...] = field(default=(), metadata=flag(skip=True))
    """Extra flags for every swarm-peer, after the testbed's own: a `PeerConfig` rendered by
    `peer_flags().to_argv` (`run_in_testbed`). Argv, not a `PeerConfig`, so that this config and `swarm testbed`
    stay free of torch and hivemind (a field typed `PeerConfig` is resolved with the flags: 0.2 s -> 2.7 s)."""
    trainer_flags: tuple[str, ...] = field(default=(), metadata=flag(skip=True))
    """Extra flags for `swarm train`, after the testbed's own: a `TrainConfig` rendered by `train_flags().to_argv`
    (`run_in_testbed`), argv for the same reason."""
    nat: tuple[int, ...] = field(
        default=(),
        metadata=flag(
            parse=_numbers(int),
            render=_joined,
            metavar="I,J,...",
            group=_NETWORK,
        ),
    )
    """Peers behind a NAT router (`swarm.testbed.nat_routers`): they can dial out, nobody can dial in."""
    nat_subnet: str = field(default="10.78.0.0/20", metadata=flag(group=_NETWORK))
    """Private IPv4 addresses behind the NAT router: NAT'd peer i has the /28 number i of it to itself
    (`nat_lan`), the router at .4 of it and the peer at .10, so no two NAT'd peers share a LAN."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_rate_mbit", tuple(float(r) for r in self.peer_rate_mbit))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "peer_flags", tuple(self.peer_flags))
        object.__setattr__(self, "trainer_flags", tuple(self.trainer_flags))
        if not 1 <= self.peers <= 200:
            raise ValueError(f"TestbedConfig.peers: expected 1-200, got {self.peers}")
        if len(self.peer_rate_mbit) > self.peers:
            raise ValueError(f"TestbedConfig.peer_rate_mbit: {len(self.peer_rate_mbit)} rates for {self.peers} peers")
        if any(r < 0 for r in self.peer_rate_mbit) or self.delay_ms < 0:
            raise ValueError("TestbedConfig: rates and delay must be >= 0")
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"TestbedConfig.prefix: expected [a-z][a-z0-9]{{0,5}}- (e.g. 'swt-'), got {self.prefix!r}")
        net = ipaddress.ip_network(self.subnet)  # raises ValueError on junk
        if net.version != 4 or not net.is_private:
            raise ValueError(f"TestbedConfig.subnet: expected a private IPv4 subnet, got {self.subnet}")
        if net.num_addresses < 12 + self.peers:
            raise ValueError(f"TestbedConfig.subnet: {self.subnet} is too small for {self.peers} peers")
        object.__setattr__(self, "nat", tuple(self.nat))
        if len(set(self.nat)) != len(self.nat) or any(type(i) is not int or not 0 <= i < self.peers for i in self.nat):
            raise ValueError(f"TestbedConfig.nat: expected distinct peer indices in [0, {self.peers}), got {self.nat}")
        lan = ipaddress.ip_network(self.nat_subnet)
        if lan.version != 4 or not lan.is_private or lan.overlaps(net) or lan.num_addresses < 16 * self.peers:
            raise ValueError(f"TestbedConfig.nat_subnet: expected a private IPv4 subnet apart from {self.subnet}")
        names = set(service_addresses(self))
        for link in self.links:
            if link.src not in names or link.dst not in names:
                raise ValueError(f"TestbedConfig.links: {link.src}:{link.dst} names a service that does not exist")
        for name in ("epochs", "train_samples", "batch_size", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TestbedConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.train_samples < self.batch_size:
            raise ValueError("TestbedConfig.train_samples: fewer samples than one batch")

    @property
    def total_steps(self) -> int:
        return self.steps or self.epochs * (self.train_samples // self.batch_size)

    def model_flags(self) -> tuple[str, ...]:
        given = {
            "--model": self.model,
            "--layers": self.layers,
            "--hidden": self.hidden,
            "--heads": self.heads,
            "--seq-len": self.seq_len,
        }
        return tuple(x for flag, value in given.items() if value is not None for x in (flag, str(value)))

    def egress_mbit(self, name: str) -> float | None:
        """Default egress bandwidth of a service, Mbit/s; None when unshaped."""
        rate = self.egress.rate_mbit
        if name.startswith("peer") and int(name[4:]) < len(self.peer_rate_mbit):
            rate = self.peer_rate_mbit[int(name[4:])]
        return rate or None


@dataclass(frozen=True)
class Service:
    """One process of the testbed, as both the namespace testbed and docker compose run it."""

    name: str
    """bootstrap, peerI or trainer."""
    address: str
    """Its IPv4 address in the subnet (the namespace's or the container's)."""
    argv: tuple[str, ...]
    """Installed entry point and flags: ('swarm', 'bootstrap', ...), ('swarm-peer', ...), ('swarm', 'train', ...)."""
    rate_mbit: float | None
    """Default egress bandwidth, Mbit/s (None: unshaped)."""
    link_rate_mbit: tuple[tuple[str, float], ...] = ()
    """Egress bandwidth to particular destination addresses, Mbit/s."""


def service_addresses(cfg: TestbedConfig) -> dict[str, str]:
    """Service name -> address, in start order (bootstrap, peers, trainer)."""
    net = ipaddress.ip_network(cfg.subnet)
    names = {"bootstrap": 2, **{f"peer{i}": 10 + i for i in range(cfg.peers)}, "trainer": 3}
    addresses = {name: str(net.network_address + offset) for name, offset in names.items()}
    for i in cfg.nat:
        addresses[f"peer{i}"] = str(nat_lan(cfg, i).network_address + 10)
    return addresses


def nat_names(cfg: TestbedConfig) -> set[str]:
    """Services behind the NAT router."""
    return {f"peer{i}" for i in cfg.nat}


def nat_lan(cfg: TestbedConfig, peer: int) -> ipaddress.IPv4Network:
    """The LAN of NAT'd peer `peer`: the /28 number `peer` of `nat_subnet` (router .4, peer .10)."""
    base = ipaddress.ip_network(cfg.nat_subnet).network_address + 16 * peer
    return ipaddress.ip_network(f"{base}/28")


def testbed_services(cfg: TestbedConfig, shared_dir: str) -> list[Service]:
    """Every service of the testbed with its argv; `shared_dir` holds the address file and outputs
    (the run directory here, the shared volume in docker compose)."""
    from swarm.daemon.bootstrap import BootstrapConfig, bootstrap_flags
    from swarm.daemon.peer_config import PeerConfig, peer_flags
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.shaper import LinkShape

    addresses = service_addresses(cfg)
    address_file = f"{shared_dir}/{ADDRESS_FILE}"
    services = []
    for name, address in addresses.items():
        if name == "bootstrap":
            dht = DHTConfig(host=address, port=BOOTSTRAP_PORT, identity_path=f"{shared_dir}/bootstrap.id")
            argv = ["swarm", "bootstrap", *bootstrap_flags().to_argv(BootstrapConfig(address_file, dht))]
        elif name == "trainer":
            argv = ["swarm", "train", *trainer_argv(cfg, address, shared_dir), *cfg.model_flags(), *cfg.trainer_flags]
        else:
            # every link's one-way delay goes last: docker's entrypoint hands it back there (swarm.testbed.compose)
            delay = PeerConfig(link_shape=LinkShape(delay_s=cfg.delay_ms / 1000))
            argv = ["swarm-peer", *peer_flags().to_argv(peer_config(cfg, name, addresses, shared_dir))]
            argv += [*cfg.model_flags(), *cfg.peer_flags, *peer_flags().to_argv(delay)]
        per_link = tuple(
            (addresses[link.dst], link.rate_mbit) for link in cfg.links if link.src == name and link.rate_mbit
        )
        services.append(Service(name, address, tuple(argv), cfg.egress_mbit(name), per_link))
    return services


def trainer_argv(cfg: TestbedConfig, address: str, shared_dir: str) -> list[str]:
    """The trainer's flags (its model's and `trainer_flags` aside): the testbed's address file, stages, address,
    training figures, output folder and metrics port, each named even at `swarm train`'s default."""
    from swarm.train.trainer import train_flags

    flags = train_flags()
    trainer = replace(
        flags.base, address_file=f"{shared_dir}/{ADDRESS_FILE}", num_stages=cfg.peers,
        dht=replace(flags.base.dht, host=address), epochs=cfg.epochs, steps=cfg.steps or None,
        train_samples=cfg.train_samples, batch_size=cfg.batch_size, micro_batches=cfg.micro_batches,
        out=f"{shared_dir}/train", metrics_port=METRICS_PORT,
    )  # fmt: skip
    always = ["--num-stages", "--host", "--epochs", "--train-samples", "--batch-size", "--micro-batches"]
    return flags.to_argv(trainer, always=always)


def peer_config(cfg: TestbedConfig, name: str, addresses: dict[str, str], shared_dir: str) -> PeerConfig:
    """What peer `name` is told: the testbed's address, ports, codecs and schedule, and the one-way delays of
    its particular links (bandwidth is the kernel's job, not the application shaper's; every link's delay and
    the model are `testbed_services`')."""
    from swarm.daemon.peer_config import PeerConfig, PlanningConfig
    from swarm.options import CodecFlags
    from swarm.peers.dht_config import DHTConfig
    from swarm.peers.shaper import LinkShape
    from swarm.peers.transport import TransportConfig
    from swarm.runtime.worker import OptimConfig

    address, total = addresses[name], cfg.total_steps
    delays = tuple(
        (f"{addresses[link.dst]}:{PEER_PORT}", LinkShape(delay_s=link.delay_ms / 1000))
        for link in cfg.links
        if link.src == name and link.delay_ms
    )
    codecs = CodecFlags(cfg.fw_codec, cfg.bw_codec).build()
    return PeerConfig(
        # the testbed's codecs on every link (a later --codec-policy among its peer flags wins)
        planning=PlanningConfig(codec_policy="fixed"),
        address_file=f"{shared_dir}/{ADDRESS_FILE}",
        dht=DHTConfig(host=address),
        transport=TransportConfig(host=address),
        num_stages=cfg.peers,
        grpc_port=PEER_PORT,
        # a fifth of the run warms up, as `swarm demo`, the app-shaped throttled cells and the torch baseline do
        # (a tenth spiked the default model's loss, and left the namespace cells on another schedule than torch's)
        optim=OptimConfig(total_steps=total, warmup_steps=max(1, round(total * 0.2))),
        checkpoint_dir=f"{shared_dir}/checkpoints",
        metrics_port=METRICS_PORT,
        link_shapes=delays,
        **codecs,
    )


def process_argv(argv: tuple[str, ...] | list[str], python: str = sys.executable) -> list[str]:
    """An installed entry point's argv as this interpreter runs it (no reliance on PATH)."""
    modules = {"swarm": "swarm.cli", "swarm-peer": "swarm.daemon.peer"}
    if argv[0] not in modules:
        raise ValueError(f"{argv[0]!r} is not a swarm entry point")
    return [python, "-m", modules[argv[0]], *argv[1:]]


def metrics_port(argv: list[str] | tuple[str, ...]) -> int | None:
    """The --metrics-port a service's argv gives (the last one, as argparse takes it); None: not served."""
    ports = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--metrics-port"]
    return int(ports[-1]) if ports else None
