"""swarm: decentralized pipeline-parallel training over slow networks, with AQ-SGD activation compression."""

import os

# gRPC core's fork support (on by default in grpcio) restarts its event-engine threads in every forked child. swarm
# forks only to exec (p2pd, with a parent-death signal set between fork and exec) or before gRPC starts, so those
# threads are never wanted there; in a process already serving gRPC (the trainer, the experiments' harness) one of
# them would poll an fd the child had closed and print "epoll_wait error: Bad file descriptor" into p2pd's output
# pipe before the exec, and hivemind then reports "Daemon failed to start" (the tenth attacks pass lost a setting to
# it twice in a row). Set before grpc is first imported; a user's own setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

# a `swarm` or `swarm-peer` process: no garbage collection while its modules import, their objects frozen after
# (`swarm.startup`); a program that imports swarm keeps its collector as it was
from swarm.startup import pause_for_imports as _pause_for_imports  # noqa: E402

_pause_for_imports()

__version__ = "0.1.0"
