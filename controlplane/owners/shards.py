"""Each replica's fair share of the claim shards: pure, no I/O. (Which shard a
conversation belongs to: kvferry.shards, shared with the routers; how long an owner may
go on deciding: controlplane.validity.)"""

from __future__ import annotations

import math

DEFAULT_SHARDS = 32
"""Shards when `--claim-shards` is not given."""


def fair_share(shards: int, live_replicas: int) -> int:
    """The most shards one replica owns when `live_replicas` share them (at least 1 live)."""
    return math.ceil(shards / max(1, live_replicas))
