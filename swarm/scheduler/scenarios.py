"""Simulated swarms: DT-FM's five scenarios from the packaged measurements, and larger synthetic ones.

The link figures are facts measured by DT-FM (Yuan et al., NeurIPS 2022) on AWS; they ship with the package
as dtfm_scenarios.json so `swarm plan --scenario worldwide` works anywhere.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

from swarm.scheduler.plans import Peer, PlanInput

__all__ = [
    "GPU_KINDS",
    "SCENARIO_NAMES",
    "Scenario",
    "load_scenario",
    "scenario_data",
    "synthetic_worldwide",
]

GB = 1e9  # DT-FM's sizes are decimal gigabytes and its bandwidths gigabits per second


def _gbps(value: float) -> float:
    return value * 1e9 / 8


# Effective training throughput (about 35-40 % of the fp16 tensor peak) and memory of common devices.
GPU_KINDS: dict[str, tuple[float, float]] = {
    "T4": (12e12, 16 * 2**30),
    "V100": (40e12, 16 * 2**30),
    "A10G": (30e12, 24 * 2**30),
    "RTX3090": (35e12, 24 * 2**30),
    "RTX4090": (70e12, 24 * 2**30),
    "A100-40GB": (100e12, 40 * 2**30),
    "A100-80GB": (110e12, 80 * 2**30),
}
_SYNTHETIC_MIX = {
    "T4": 0.2,
    "V100": 0.15,
    "A10G": 0.15,
    "RTX3090": 0.2,
    "RTX4090": 0.15,
    "A100-40GB": 0.1,
    "A100-80GB": 0.05,
}
DTFM_GPU = "V100"  # DT-FM's simulations use p3 instances (V100 16 GB)

SCENARIO_NAMES = ("datacenter", "spot", "multi-universities", "regional", "worldwide", "homogeneous")
_KEYS = ("0_datacenter", "1_spot_datacenter", "2_multi_universities", "3_regional", "4_worldwide", "5_homogeneous")
WORLDWIDE_REGIONS = ("Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland")


@functools.cache
def scenario_data() -> dict:
    """The packaged DT-FM measurements and scenario descriptions."""
    return json.loads(resources.files("swarm.scheduler").joinpath("dtfm_scenarios.json").read_text())


@dataclass(frozen=True, eq=False)
class Scenario:
    """One of DT-FM's simulated swarms with its workload (GPT-3 XL, 8 stages x 8 replicas)."""

    name: str
    plan_input: PlanInput
    activation_bytes: float
    """DT-FM's activation size per pipeline step."""
    gradient_bytes: float
    """DT-FM's gradient size per stage."""
    stages: int = 8
    replicas: int = 8


def _resolve(name: str) -> int:
    text = name.strip().lower().replace("_", "-")
    if text.isdigit() and int(text) < len(_KEYS):
        return int(text)
    for i, (short, key) in enumerate(zip(SCENARIO_NAMES, _KEYS, strict=True)):
        if text in (short, key.replace("_", "-"), key.split("_", 1)[1].replace("_", "-")):
            return i
    raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIO_NAMES)} or 0-5")


def _region_pair(a: str, b: str) -> tuple[float, float]:
    """(delay_ms, bandwidth_gbps) between two regions from DT-FM's measured table."""
    pairs = scenario_data()["region_pairs"]
    entry = pairs.get(f"{a}-{b}") or pairs.get(f"{b}-{a}")
    if entry is None:
        raise KeyError(f"no measurement between {a} and {b}")
    return entry["delay_ms"], entry["bandwidth_gbps"]


def _by_labels(labels: list[str], link) -> tuple[np.ndarray, np.ndarray]:
    """Delay (s) and bandwidth (bytes/s) matrices from a per-peer label and link(label_a, label_b)."""
    n = len(labels)
    delay = np.zeros((n, n))
    bandwidth = np.full((n, n), np.inf)
    cache: dict[tuple[str, str], tuple[float, float]] = {}
    for i in range(n):
        for j in range(n):
            if i != j:
                key = (labels[i], labels[j])
                if key not in cache:
                    cache[key] = link(*key)
                delay_ms, gbps = cache[key]
                delay[i, j], bandwidth[i, j] = delay_ms / 1e3, _gbps(gbps)
    return delay, bandwidth


def _layout(index: int) -> tuple[list[str], object]:
    """Per-peer labels and the link function of scenario `index`, as DT-FM's simulator builds them."""
    spec = scenario_data()["scenarios"][_KEYS[index]]
    n = spec["devices"]
    if index == 0:
        labels = [f"instance-{i // 8}" for i in range(n)]
        inside, between = spec["within_instance_gbps"], spec["between_instances_gbps"]
        return labels, lambda a, b: (spec["delay_ms"], inside if a == b else between)
    if index == 1:
        labels = [f"spot-{i // 4}" if i < 32 else f"standalone-{i}" for i in range(n)]
        inside, other = spec["within_instance_gbps"], spec["otherwise_gbps"]
        return labels, lambda a, b: (spec["delay_ms"], inside if a == b and a.startswith("spot") else other)
    if index == 2:
        labels = ["Ohio" if i < n // 2 else "Virginia" for i in range(n)]
        inside, between = spec["within_site"], spec["between_sites"]
        return (
            labels,
            lambda a, b: (
                (inside["delay_ms"], inside["bandwidth_gbps"])
                if a == b
                else (between["delay_ms"], between["bandwidth_gbps"])
            ),
        )
    if index == 3:
        names = ("Virginia", "Oregon", "California", "Ohio")
        labels = [names[i * len(names) // n] for i in range(n)]
        inside, table = spec["within_region"], spec["between"]

        def link(a: str, b: str) -> tuple[float, float]:
            if a == b:
                return inside["delay_ms"], inside["bandwidth_gbps"]
            delay_ms, gbps = table.get(f"{a}-{b}") or table[f"{b}-{a}"]
            return delay_ms, gbps

        return labels, link
    if index == 4:
        labels = [WORLDWIDE_REGIONS[i * len(WORLDWIDE_REGIONS) // n] for i in range(n)]
        return labels, _worldwide_link
    labels = ["tc"] * n
    every = spec["all_links"]
    return labels, lambda a, b: (every["delay_ms"], every["bandwidth_gbps"])


def _worldwide_link(a: str, b: str) -> tuple[float, float]:
    if a == b:
        inside = scenario_data()["scenarios"]["4_worldwide"]["within_region"]
        return inside["delay_ms"], inside["bandwidth_gbps"]
    return _region_pair(a, b)


def load_scenario(name: str | int) -> Scenario:
    """One of DT-FM's scenarios by name (datacenter, spot, multi-universities, regional, worldwide,
    homogeneous) or index 0-5, with DT-FM's GPUs (V100 16 GB) as peers."""
    index = _resolve(str(name))
    labels, link = _layout(index)
    delay, bandwidth = _by_labels(labels, link)
    flops, memory = GPU_KINDS[DTFM_GPU]
    peers = tuple(Peer(f"peer-{i:03d}", flops, memory, labels[i]) for i in range(len(labels)))
    spec = scenario_data()["scenarios"][_KEYS[index]]
    workload = scenario_data()["workload"]
    # a scenario without sizes of its own uses the workload's (DT-FM's code uses the same sizes for all)
    return Scenario(
        name=SCENARIO_NAMES[index],
        plan_input=PlanInput(peers, delay, bandwidth),
        activation_bytes=spec.get("activation_gb", workload["activation_gb"]) * GB,
        gradient_bytes=spec.get("gradient_gb", workload["gradient_gb"]) * GB,
        stages=workload["pipeline_stages"],
        replicas=workload["data_parallel_replicas"],
    )


def synthetic_worldwide(n_peers: int, seed: int = 0) -> PlanInput:
    """`n_peers` peers spread at random over the worldwide scenario's eight regions, each a device drawn
    from a mix of GPU kinds (12-110 TFLOP/s, 16-80 GiB), linked by DT-FM's measured region figures."""
    rng = np.random.default_rng(seed)
    regions = sorted(rng.integers(0, len(WORLDWIDE_REGIONS), size=n_peers).tolist())
    labels = [WORLDWIDE_REGIONS[r] for r in regions]
    kinds = list(_SYNTHETIC_MIX)
    drawn = rng.choice(len(kinds), size=n_peers, p=[_SYNTHETIC_MIX[k] for k in kinds])
    delay, bandwidth = _by_labels(labels, _worldwide_link)
    peers = tuple(
        Peer(f"peer-{i:04d}", *GPU_KINDS[kinds[k]], region=f"{labels[i]}/{kinds[k]}") for i, k in enumerate(drawn)
    )
    return PlanInput(peers, delay, bandwidth)
