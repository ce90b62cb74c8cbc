"""kvpool's client library: talk to a running kvpoold over ZeroMQ.

from kvpool.client import Client, KvpoolError
with Client() as client, client.open_session(task="voice") as s:
    print(s.complete("Hello", max_tokens=16, temperature=0.0).text)
"""

from .client import Client, Session, Stream
from .errors import DaemonUnavailable, KvpoolError, RequestTimeout
from .media import Audio, Image
from .results import Completion

__all__ = [
    "Audio",
    "Client",
    "Completion",
    "DaemonUnavailable",
    "Image",
    "KvpoolError",
    "RequestTimeout",
    "Session",
    "Stream",
]
__version__ = "0.1.0"
