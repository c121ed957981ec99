"""How long a turn waits for the daemon's lookup answer. Pure: numbers in, seconds out.

What the wait can win is the prompt's recompute time: a pull spares P computing what D
holds (seconds at 32k tokens), so a turn whose prompt costs seconds to recompute may
wait longer for the answer than one of a hundred tokens, for which a missed pull costs
milliseconds. The wait is a base, plus a share of the prompt's estimated recompute time
(its tokens at the measured prefill rate: the reusable part is at most the prompt),
capped. A fixed 50 ms made 20-55% of the turns that could pull skip reuse on a busy
machine, each recomputing the whole history.

The prefill rate is measured from this router's own prefills that computed many tokens
(their time over the tokens P computed), per model, starting from a configured estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Prefills that computed fewer tokens tell little about the rate (fixed costs dominate).
MIN_MEASURED_TOKENS = 256
#: Weight of each new measurement in the running estimate.
RATE_WEIGHT = 0.2


@dataclass(frozen=True)
class Patience:
    """The lookup wait's parameters (`router.settings.DaemonSettings` has each one's doc)."""

    base_s: float
    recompute_share: float
    max_s: float


def lookup_wait_s(
    p: Patience, prompt_tokens: int, s_per_token: float, busy_s: float = 0.0, lag_s: float = 0.0
) -> float:
    """Seconds to wait for the lookup's answer once the prompt is known: `p.base_s` plus
    `p.recompute_share` of the prompt's estimated recompute time, at most `p.max_s` (or the
    base, if that is longer); and
    at least `busy_s`, the time the turn waits for something else anyway (the prefill
    scores): an answer that comes meanwhile costs nothing to use. Plus `lag_s` (at most
    `p.max_s`), how late the router's own loop runs (`kvferry.looplag`): an answer that
    came in time is read that much late, and the turn's prefill starts that much late too."""
    recompute_s = max(prompt_tokens, 0) * max(s_per_token, 0.0)
    wait = max(min(p.base_s + p.recompute_share * recompute_s, max(p.max_s, p.base_s)), busy_s)
    return wait + min(max(lag_s, 0.0), p.max_s)


class PrefillRates:
    """Seconds per computed prompt token, per model, as this router's prefills took them."""

    def __init__(self, initial_s_per_token: float) -> None:
        self._initial = initial_s_per_token
        self._rates: dict[str, float] = {}

    def s_per_token(self, model: str) -> float:
        return self._rates.get(model, self._initial)

    def observe(self, model: str, computed_tokens: int, seconds: float) -> None:
        """A prefill computed `computed_tokens` (the prompt less what it pulled) in `seconds`
        (P's answer, queueing included: waiting for a busy P is part of recomputing)."""
        if computed_tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        measured = seconds / computed_tokens
        old = self._rates.get(model)
        self._rates[model] = measured if old is None else old + RATE_WEIGHT * (measured - old)
