"""Whether the engine's KV-event publisher is connected: a monitor on the SUB socket.

vLLM's publisher lives in the engine-core process. When that process dies the
kernel closes its sockets, and the SUB socket's monitor reports
EVENT_DISCONNECTED within milliseconds: long before a probe could tell, and
before a restarted engine could serve a stale pull (identity.py). The engine is
then suspended until a probe confirms its identity; when a publisher is back
(EVENT_CONNECTED after a disconnection) the engine is probed at once.
"""

from __future__ import annotations

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from sidecar.engine import EngineInstance

log = structlog.get_logger(__name__)

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


async def watch_publisher(sub: zmq.asyncio.Socket, instance: EngineInstance, rank: int) -> None:
    """Follow `sub`'s connection to the publisher until cancelled (the monitor is closed then)."""
    monitor = sub.get_monitor_socket(_EVENTS)
    lost = False
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                lost = True
                log.warning("kvevents.publisher.disconnected", rank=rank)
                instance.suspend("kv_disconnect")
            elif event == zmq.EVENT_CONNECTED and lost:
                lost = False
                log.info("kvevents.publisher.connected", rank=rank)
                instance.probe_now.set()
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
