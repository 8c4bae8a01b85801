"""One-line structured logs: every record is a JSON object on one line (ts, level, component, msg, fields)."""

from __future__ import annotations

import json
import logging
import time

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field of the event.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonLineFormatter(logging.Formatter):
    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        event.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str)


def setup_logging(component: str, level: str = "info", json_lines: bool = True) -> None:
    handler = logging.StreamHandler()
    if json_lines:
        handler.setFormatter(JsonLineFormatter(component))
    else:
        handler.setFormatter(logging.Formatter(f"[{component} %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # One line per health probe or heartbeat is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
