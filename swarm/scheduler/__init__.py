"""Bandwidth-aware scheduler: which peers host which layers, in which order, after DT-FM (NeurIPS 2022)."""

from swarm.scheduler.plans import Breakdown, ModelSpec, Peer, Plan, PlanInput, StagePlan, TransformerShape
from swarm.scheduler.search import SearchConfig, plan, plan_dtfm

__all__ = [
    "Breakdown",
    "ModelSpec",
    "Peer",
    "Plan",
    "PlanInput",
    "SearchConfig",
    "StagePlan",
    "TransformerShape",
    "plan",
    "plan_dtfm",
]
