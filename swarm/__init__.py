"""swarm: decentralized pipeline-parallel training over slow networks, with AQ-SGD activation compression."""

__version__ = "0.1.0"
