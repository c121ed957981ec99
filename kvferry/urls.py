"""The one check of an engine or sidecar URL, shared by the daemon and every settings
parser (they disagreed: the daemon refused what a sidecar had accepted at start-up)."""

from __future__ import annotations

from urllib.parse import urlsplit


def is_http_url(url: str) -> bool:
    """An http:// or https:// URL (scheme in any case) with a host."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
