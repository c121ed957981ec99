"""How big a fuzz campaign is, and how its memory is measured.

`make test` runs every campaign with a fixed seed and a few dozen examples a test (the
whole of tests/fuzz in well under a minute on a busy 2-core machine). A longer hunt by
hand: ``KVFERRY_FUZZ_EXAMPLES=1000 KVFERRY_FUZZ_RANDOM=1 pytest tests/fuzz`` (random
seeds; hypothesis prints how to reproduce what it finds).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

T = TypeVar("T")


def fuzz(examples: int = 25, shrink: bool = True) -> Callable[[Any], Any]:
    """Hypothesis settings of a fuzz test: `examples` of them (KVFERRY_FUZZ_EXAMPLES's for a
    longer campaign by hand), derandomized unless
    KVFERRY_FUZZ_RANDOM is set; the processes under test are shared, not per example.
    Without `shrink` a failure is reported as found (a target whose state carries over
    from one example to the next does not fail alike on a smaller one)."""
    return settings(
        max_examples=int(os.environ.get("KVFERRY_FUZZ_EXAMPLES", examples)),
        derandomize="KVFERRY_FUZZ_RANDOM" not in os.environ,
        database=None,
        phases=list(Phase) if shrink else [Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def corpus(strategy: st.SearchStrategy[T], count: int) -> list[T]:
    """`count` examples of `strategy`, the same every run (for a campaign replayed
    round after round, as the memory tests do)."""
    drawn: list[T] = []

    @settings(max_examples=count, derandomize=True, database=None)
    @given(strategy)
    def collect(example: T) -> None:
        drawn.append(example)

    collect()
    return drawn[:count]


def rss_growth_kib(before: int, after: int) -> int:
    """Resident memory gained between two VmRSS readings (KiB; a loss counts 0)."""
    return max(0, after - before)
