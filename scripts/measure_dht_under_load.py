"""Whether a DHT record stays readable across a testbed link a bulk flow fills (root: network namespaces).

Two bare hivemind DHT nodes in two namespaces joined like a testbed link (`swarm.testbed.netns.shaped_pair`): a stores
a record every 5 s (30 s lifetime), b reads it every second; after 8 s on the idle link a bulk TCP flow a -> b fills
it. Prints b's reads (found, latency) for hivemind's RPC timeout `--wait-timeout` (its default: 3 s), the question
being whether the queue behind the flow (`scripts/measure_queue_delay.py`) makes the record lapse.

Usage: python scripts/measure_dht_under_load.py [--rate 0.5] [--wait-timeout 3] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

A_IP, B_IP = "10.77.254.1", "10.77.254.2"


async def _node(role: str, wait_s: float, seconds: float, maddr_file: str) -> None:
    from hivemind.dht.node import DHTNode
    from hivemind.utils.timed_storage import get_dht_time

    ip = A_IP if role == "store" else B_IP
    initial = None if role == "store" else [Path(maddr_file).read_text().strip()]
    node = await DHTNode.create(initial_peers=initial, host_maddrs=[f"/ip4/{ip}/tcp/31337"], wait_timeout=wait_s)
    end = time.monotonic() + seconds
    if role == "store":
        maddr = next(str(m) for m in await node.protocol.p2p.get_visible_maddrs() if ip in str(m))
        tmp = maddr_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(maddr if "/p2p/" in maddr else f"{maddr}/p2p/{node.peer_id}")
        os.replace(tmp, maddr_file)
        while time.monotonic() < end:
            start = time.monotonic()
            await node.store("record", "v" * 64, get_dht_time() + 30)
            await asyncio.sleep(max(0.0, 5 - (time.monotonic() - start)))
    else:
        reads = []
        while time.monotonic() < end:
            start = time.monotonic()
            found = await node.get("record", latest=True)
            took = time.monotonic() - start
            reads.append((found is not None and found.expiration_time > get_dht_time(), took))
            await asyncio.sleep(max(0.0, 1 - took))
        print(json.dumps(reads))
    await node.shutdown()


def _in(ns: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], **kw)


def main() -> int:
    if sys.argv[1:2] == ["--role"]:
        asyncio.run(_node(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]))
        return 0
    from swarm.testbed.netns import shaped_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.5, help="link rate, Mbit/s")
    parser.add_argument("--wait-timeout", type=float, default=3.0, help="hivemind's RPC timeout, s")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of reads")
    args = parser.parse_args()
    queue = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measure_queue_delay.py")
    with tempfile.TemporaryDirectory() as tmp, shaped_pair(args.rate, prefix="sdh-") as (a, b):
        maddr = os.path.join(tmp, "maddr")
        me = os.path.abspath(__file__)
        store = _in(a, me, "--role", "store", str(args.wait_timeout), str(args.seconds + 30), maddr)
        deadline = time.monotonic() + 30
        while not os.path.exists(maddr) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the first node's address file, bounded
        reader = _in(b, me, "--role", "get", str(args.wait_timeout), str(args.seconds), maddr,
                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(8.0)  # reads on the idle link first
        sink = _in(b, queue, "--role", "sink")
        time.sleep(0.5)
        flow = _in(a, queue, "--role", "send", str(args.seconds + 20))
        try:
            reads = json.loads(reader.communicate(timeout=args.seconds + 120)[0])
        finally:
            for p in (flow, sink, store):
                p.kill()
                p.wait(5)
    found = [took for ok, took in reads if ok]
    print(json.dumps({
        "rate_mbit": args.rate, "wait_timeout_s": args.wait_timeout, "reads": len(reads), "found": len(found),
        "median_s": sorted(found)[len(found) // 2] if found else None, "max_s": max(found) if found else None,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
