"""A child forked from a process that runs gRPC starts with one thread: gRPC's fork support, which would restart
its event-engine threads in the child (and let one print into p2pd's output pipe before the exec), is off once
swarm is imported."""

from __future__ import annotations

import os
import subprocess
import sys

CHILD_THREADS = """
import os, subprocess, concurrent.futures
import swarm, grpc
server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
server.add_insecure_port("127.0.0.1:0")
server.start()
def count():  # runs in the child between fork and exec, as the parent-death signal's preexec does for p2pd
    os.write(1, str(len(os.listdir("/proc/self/task"))).encode())
print(subprocess.run(["/bin/true"], preexec_fn=count, capture_output=True).stdout.decode())
server.stop(None)
"""


def child_threads(env_setting: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    if env_setting is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = env_setting
    out = subprocess.run([sys.executable, "-c", CHILD_THREADS], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_a_child_forked_beside_grpc_has_no_grpc_threads():
    assert child_threads(None) == 1


def test_a_users_own_setting_wins():
    assert child_threads("1") > 1  # gRPC's fork support, asked for: its threads come back in the child
