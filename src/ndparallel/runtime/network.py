"""Whether a server answers, checked once before any rank starts (the Hub, a tracker's server):
one TCP connection with a short timeout instead of a library's minutes of retries."""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout_s`` (one try, no retries);
    the port is the URL's, else 80 for ``http://`` and 443 otherwise."""
    parsed = urlparse(url)
    port = parsed.port or (80 if parsed.scheme == "http" else 443)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False
