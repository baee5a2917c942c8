"""Experiments: programs that train or measure, write CSV/PNG/JSON under --out, and print a table."""


def rotated(settings: tuple[str, ...], k: int) -> tuple[str, ...]:
    """Round k's order of interleaved timed rounds: the settings started at the k-th, so no setting is always
    first or last (`swarm experiment freezing`, `swarm experiment nat`)."""
    k %= max(1, len(settings))
    return settings[k:] + settings[:k]
