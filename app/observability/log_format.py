"""Log lines for people (text) or for log pipelines (one JSON object a line), each with its request id."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from app.web.request_context import RequestIdLogFilter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
TEXT_DATE_FORMAT = "%H:%M:%S"
# Loggers whose INFO lines are for the operator: loraplex's own, and the server's request log. Every other
# library's records reach the log from WARNING up, unless the level is "debug".
OWN_LOGGERS = ("app", "engine", "loraplex_kernels", "__main__", "uvicorn.access")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, request_id, message, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class LibraryLogFilter(logging.Filter):
    """Passes loraplex's own records, and other libraries' from ``min_library_level`` up.

    A filter on the handler rather than levels on the libraries' loggers, so it holds for every library, known
    or not, and for the records the engine worker process forwards (re-logged here under their own names).
    """

    def __init__(self, min_library_level: int) -> None:
        super().__init__()
        self._min_library_level = min_library_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self._min_library_level:
            return True
        return any(record.name == own or record.name.startswith(own + ".") for own in OWN_LOGGERS)


def configure_logging(json_lines: bool, level: str = "info") -> None:
    """Send log records of ``level`` ("debug", "info", "warning", "error") and up to stderr, as text or as
    JSON lines, with the request id attached; below "debug", other libraries' lines only from WARNING up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdLogFilter())
    if level != "debug":
        handler.addFilter(LibraryLogFilter(logging.WARNING))
    handler.setFormatter(JsonLogFormatter() if json_lines else logging.Formatter(TEXT_FORMAT, TEXT_DATE_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)
