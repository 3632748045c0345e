"""Log lines for people (text) or for log pipelines (one JSON object a line), each with its request id."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from app.web.request_context import RequestIdLogFilter

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
TEXT_DATE_FORMAT = "%H:%M:%S"


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


def configure_logging(json_lines: bool) -> None:
    """Send every log record to stderr, as text or as JSON lines, with the request id attached."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdLogFilter())
    handler.setFormatter(JsonLogFormatter() if json_lines else logging.Formatter(TEXT_FORMAT, TEXT_DATE_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
