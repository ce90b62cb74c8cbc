"""The daemon's logging: plain text or one JSON object per line (journald-friendly) on stderr, optionally also
to a size-rotated file. llama.cpp's own messages arrive through the same loggers (see model.py)."""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "thread": record.threadName,
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text", file: str = "", max_bytes: int = 10 << 20) -> None:
    formatter: logging.Formatter = (
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file:
        handlers.append(logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes, backupCount=3, encoding="utf-8"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level.upper())
