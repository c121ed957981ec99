"""Which engine process answers: its identity, and what each probe's answer means.

A node's retentions name blocks in one engine process's memory. P reads them with
a one-sided NIXL READ that D's CPU never checks, and P finds D by its engine id:
vLLM caches a handshake per engine id and, for an id it has no handshake for,
handshakes with whatever process listens at D's side channel. With a fixed engine
id (``kv_transfer_config.engine_id``) a restarted D is the same id to P, so P
reads the *new* process's memory at the old block ids: wrong KV, silently, which
P then caches. So no retention may be handed out for a process other than the one
that registered it. Silence is not that signal: a D stalled for seconds, or an API
server busy tokenizing a huge prompt, fails its probes and still holds every
block. The process's identity is:

- ``process_start_time_seconds`` on /metrics (the API server's; vLLM's API server
  exits when its engine core dies), else
- the earliest ``*_created`` sample (the counters' creation times, per process),
- else unknown: an engine answering again after failing is then taken for a new
  process (fail safe), as before.

States (`IdentityTracker`, pure): STARTING (no identity of the current epoch yet),
UP (vouched for), SUSPENDED (the engine stopped answering or a signal put it in
doubt: its identity must be confirmed). While not UP the node has no Attach
stream, and a stream that ends suspends the node at the daemon (liveness ended
at once, generation kept: lookups answer node_gone and hand nothing out, and
nothing is voided). An answer with the same identity resumes it: the sidecar
registers the node again with its known generation and every retention is good
again (a stall is not a restart). Another identity is a new epoch: registered with
generation 0, the daemon assigns the next one and the old retentions are dead.
The identity is read at every successful probe, not only after a failure.

The fencing argument (why no pull reaches another process than the one that
registered its retention). Let D's old process die at t0 and a new one be able to
serve side-channel handshakes at t1 (vLLM: a minute of loading; the emulator:
milliseconds).

1. The sidecar suspends the node at the daemon as soon as it learns of the death:
   the KV-event SUB socket's monitor reports the publisher's disconnection within
   milliseconds of t0 (kvmonitor.py); a probe refused (nothing listening) or
   ``health_failures`` failed probes do so later; a KV-event seq going backwards,
   a new engine id in D's params or another identity on a probe start a new epoch
   (also suspended until registered). Suspending = closing the Attach stream; the
   daemon suspends the node when the stream ends (conditionally on the record
   still being that registration, so a late end never suspends a newer one).
2. The node is registered again (un-suspended) only once a probe answered with
   the epoch's identity, or at a new generation for a new identity: every
   registration follows an identity read, and every Attach stream a registration.
3. At the daemon a pull is decided on a linearizable read of the node, made after
   the retention was claimed (controlplane/service.py ``_decide``): a lookup whose
   read follows the suspension (or the new generation) in etcd's order cannot
   pull; the replicas' cached views do not decide pulls.
4. So a stale pull needs a lookup decided before the suspension landed and read by
   P after t1: the death-to-suspension delay (milliseconds with KV events; with
   none, up to a probe interval plus a probe's timeout) plus a pull's decision-to-
   read delay (milliseconds) must exceed the new process's start. P with a cached
   handshake of the old process fails such a read instead (the READ targets the
   dead agent). A random engine id per start (vLLM's default) closes even that:
   P's handshake checks the id.
5. Sidecar and engine restarted together (a pod restart): the old sidecar's stream
   ends when it dies, so the daemon suspends the node then; the new sidecar
   registers the new process (its start time differs) at a new generation. A pod
   whose connections vanish without a FIN (its network torn down first) is left
   alive until its liveness lapses (the TTL, 10 s) or the daemon's keepalive pings
   end the stream: a window only an engine starting faster than that can use
   (vLLM takes a minute), which a sidecar suspending its node at its own start,
   before it knows the engine, would close (not done: no RPC for it yet).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

_PROCESS_START = re.compile(r"^process_start_time_seconds(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_CREATED = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*_created(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class Identity:
    """One engine process: which signal told it, and that signal's value (Unix seconds)."""

    kind: str
    """"start" (process_start_time_seconds) or "created" (the earliest counter creation)."""
    value: float


def _time(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:  # (not a number: an engine's bug)
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def started_at_of(metrics_text: str) -> float:
    """The engine process's start (Unix seconds) from ``process_start_time_seconds``, 0.0
    when not exposed (vLLM with several API servers serves multiprocess metrics without it)."""
    m = _PROCESS_START.search(metrics_text)
    return _time(m.group(1)) if m else 0.0


def identity_of(metrics_text: str) -> Identity | None:
    """The process identity a /metrics text shows (see the module doc), None if none."""
    started = started_at_of(metrics_text)
    if started:
        return Identity("start", started)
    created = [t for t in map(_time, _CREATED.findall(metrics_text)) if t]
    return Identity("created", min(created)) if created else None


class Answer(enum.Enum):
    """What one probe of the engine got."""

    OK = "ok"
    """/health answered 200."""
    REFUSED = "refused"
    """Nothing listens: the process is gone (or not started yet)."""
    FAILED = "failed"
    """Timed out or answered an error: maybe only busy."""


class State(enum.Enum):
    STARTING = "starting"
    UP = "up"
    SUSPENDED = "suspended"


class Step(enum.Enum):
    """What the sidecar does about a probe."""

    NONE = "none"
    UP = "up"
    """The current epoch's process answered for the first time: vouch for it."""
    SUSPEND = "suspend"
    """The process is in doubt: its retentions must not be handed out."""
    RESUME = "resume"
    """The same process answers again: its retentions are good."""
    RESTART = "restart"
    """Another process answers: a new epoch."""


@dataclass
class IdentityTracker:
    """Probe answers and identities -> steps. Pure."""

    failures_to_down: int
    state: State = State.STARTING
    known: Identity | None = None
    """The identity of the current epoch's process (None: not known, or not exposed)."""
    failures: int = 0

    def observe(self, answer: Answer, identity: Identity | None = None) -> Step:
        if answer is Answer.OK and self.known is not None and identity is None:
            answer = Answer.FAILED  # (it showed its identity before: it cannot be vouched for now)
        if answer is not Answer.OK:
            self.failures += 1
            if self.state is State.UP and (
                answer is Answer.REFUSED or self.failures >= self.failures_to_down
            ):
                self.state = State.SUSPENDED
                return Step.SUSPEND
            return Step.NONE
        self.failures = 0
        if self.state is State.STARTING:
            self.state, self.known = State.UP, identity
            return Step.UP
        if identity is not None and identity == self.known:
            if self.state is State.SUSPENDED:
                self.state = State.UP
                return Step.RESUME
            return Step.NONE
        if identity is None and self.known is None and self.state is State.UP:
            return Step.NONE  # (an engine showing no identity, answering all along)
        # Another identity, or none to compare after a doubt: a new process (fail safe).
        self.state, self.known = State.UP, identity
        return Step.RESTART

    def suspend(self) -> bool:
        """A signal put the process in doubt. -> whether it was vouched for until now."""
        if self.state is not State.UP:
            return False
        self.state = State.SUSPENDED
        return True

    def forget(self) -> None:
        """A new epoch started on another signal: the next identity answered is its own."""
        self.state, self.known, self.failures = State.STARTING, None, 0
