"""The usage spool: every usage record on local disk, fsync'd, until PostgreSQL holds it.

The spool is one append-only file of JSON lines in the data folder. A record is appended and fsync'd by
the spool's thread (group commit: the records that arrive while one fsync runs share the next), and the
reply waits for it, so a crash or a ``kill -9`` loses no record a client was answered for. Once the writer
has every record up to a sequence number in the table, those lines are released; the file is cut to the
records still unwritten, by truncation when none is left, else by a rewrite through a temporary file and a
rename (a crash leaves the old file or the new one, never half of one). At start the file is read back,
each request id once (the table's unique ``request_id`` makes a record written twice count once).

The spool is bounded: past ``max_bytes`` of unwritten records it reports itself full and the gateway
refuses new requests with a 503 rather than serve what it could not bill; the requests already running
still append theirs. Each gateway process holds one slot (``usage-spool.jsonl``, ``usage-spool-1.jsonl``,
...) under an exclusive lock, so several gateways on one data folder never write the same file.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec

from app.usage.records import UsageRecord

logger = logging.getLogger(__name__)

MAX_SLOTS = 64  # gateway processes that can share one data folder, each with a spool of its own
RETRY_AFTER_ERROR_S = 1.0  # a spool that cannot be written (a full disk) is tried again this often
# Released lines are cut out of the file once they weigh this much and at least as much as the live ones:
# a rewrite copies the live lines, so it costs at most as much as the appends it reclaims.
MIN_COMPACTION_BYTES = 1024**2
GROWTH_LOG_FIRST_BYTES = 1024**2  # a warning when the unwritten records pass 1 MiB, then at each doubling


class SpoolLockedError(RuntimeError):
    """Every spool slot of the data folder is held by another process."""


@dataclass(slots=True)
class _Line:
    seq: int
    data: bytes


@dataclass(slots=True)
class _Append:
    line: _Line
    durable: concurrent.futures.Future[None]


class UsageSpool:
    """An fsync'd file of the usage records PostgreSQL does not hold yet; see the module docstring."""

    def __init__(self, folder: Path, stem: str, *, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        self._folder = folder
        self._stem = stem
        self._max_bytes = max_bytes
        self.path: Path | None = None
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._encoder = msgspec.json.Encoder()
        self._cond = threading.Condition()
        self._appends: list[_Append] = []  # waiting for the thread; guarded by _cond
        self._released_seq = -1  # every record up to this sequence number is in the table; guarded by _cond
        self._closing = False
        self._error: OSError | None = None
        self._live: deque[_Line] = deque()  # the file's lines not yet released, oldest first (the thread's alone)
        self._file_bytes = 0
        self._live_bytes = 0  # read by other threads: an int, written whole
        self._next_growth_log_bytes = GROWTH_LOG_FIRST_BYTES
        self._was_full = False
        self._thread: threading.Thread | None = None

    @property
    def num_bytes(self) -> int:
        """Bytes of records the spool holds that the table does not (yet)."""
        return self._live_bytes

    @property
    def is_full(self) -> bool:
        return self._live_bytes >= self._max_bytes

    @property
    def error(self) -> OSError | None:
        """Why the last append could not be written (None once one is): records wait in memory meanwhile."""
        return self._error

    def open(self, first_seq: int) -> list[tuple[int, UsageRecord]]:
        """Take a free slot, read its records back (numbered from ``first_seq``) and start the thread."""
        self._folder.mkdir(parents=True, exist_ok=True)
        self._take_slot()
        self._closing = False
        assert self.path is not None
        records = self._read_back(first_seq)
        self._live = deque(_Line(seq, self._encoder.encode(rec) + b"\n") for seq, rec in records)
        self._rewrite()  # the file as read back: each request id once, no line torn by a crash
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="usage-spool", daemon=True)
        self._thread.start()
        if records:
            logger.info("re-queued %d usage records from %s", len(records), self.path)
        return records

    def append(self, seq: int, rec: UsageRecord) -> concurrent.futures.Future[None]:
        """Queue one record; the future is done once it is on disk (or released first). Never blocks."""
        durable: concurrent.futures.Future[None] = concurrent.futures.Future()
        line = _Line(seq, self._encoder.encode(rec) + b"\n")
        with self._cond:
            self._appends.append(_Append(line, durable))
            self._cond.notify()
        return durable

    def release(self, seq: int) -> None:
        """Every record up to ``seq`` is in the table: its line may go."""
        with self._cond:
            if seq > self._released_seq:
                self._released_seq = seq
                self._cond.notify()

    def close(self) -> None:
        """Write what is queued, stop the thread and give the slot back; the unwritten records stay in the file."""
        if self._thread is not None:
            with self._cond:
                self._closing = True
                self._cond.notify()
            self._thread.join()
            self._thread = None
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None
        if self._live:
            logger.warning("%d usage records not in the database yet are kept in %s", len(self._live), self.path)

    def _take_slot(self) -> None:
        for slot in range(MAX_SLOTS):
            name = self._stem if slot == 0 else f"{self._stem}-{slot}"
            lock_fd = os.open(self._folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                continue
            self._lock_fd, self.path = lock_fd, self._folder / f"{name}.jsonl"
            return
        raise SpoolLockedError(
            f"all {MAX_SLOTS} usage spools in {self._folder} are held by other processes; "
            "give this gateway a data folder of its own (LORAPLEX_HOME)"
        )

    def _read_back(self, first_seq: int) -> list[tuple[int, UsageRecord]]:
        assert self.path is not None
        if not self.path.is_file():
            return []
        decoder = msgspec.json.Decoder(UsageRecord)
        records: list[tuple[int, UsageRecord]] = []
        seen: set[str] = set()
        for number, line in enumerate(self.path.read_bytes().splitlines(), start=1):
            try:
                rec = decoder.decode(line)
            except (msgspec.DecodeError, ValueError) as error:  # a line torn by a crash, or damaged
                logger.error("skipped line %d of the usage spool %s: %s", number, self.path, error)
                continue
            if rec.request_id not in seen:
                seen.add(rec.request_id)
                records.append((first_seq + len(records), rec))
        return records

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._appends or self._closing or self._released_seq >= self._first_live_seq()):
                    self._cond.wait()
                appends, self._appends = self._appends, []
                released_seq, closing = self._released_seq, self._closing
            kept = [a for a in appends if a.line.seq > released_seq]
            self._write(kept)
            for append in appends:
                if not append.durable.done():
                    append.durable.set_result(None)
            self._compact(released_seq)
            if closing:
                return

    def _first_live_seq(self) -> int:
        return self._live[0].seq if self._live else 1 << 62

    def _write(self, appends: list[_Append]) -> None:
        """Append and fsync the lines; while the disk refuses them, retry (they also wait in the writer's memory)."""
        if not appends:
            return
        data = b"".join(a.line.data for a in appends)
        while True:
            try:
                _write_all(self._fd, data)
                os.fsync(self._fd)
                break
            except OSError as error:
                self._undo_partial_write()
                if self._error is None:
                    logger.error("cannot write the usage spool %s (%s); new requests are refused", self.path, error)
                self._error = error
                with self._cond:
                    if self._closing:
                        logger.error("%d usage records could not be spooled at shutdown: lost", len(appends))
                        return
                    self._cond.wait(RETRY_AFTER_ERROR_S)
        if self._error is not None:
            logger.info("the usage spool %s is written again", self.path)
            self._error = None
        self._live.extend(a.line for a in appends)
        self._file_bytes += len(data)
        self._live_bytes += len(data)
        self._log_growth()

    def _undo_partial_write(self) -> None:
        """Cut the file back to its last whole line, so the next append does not glue onto a torn one."""
        try:
            os.ftruncate(self._fd, self._file_bytes)
        except OSError as error:
            logger.debug("could not cut the usage spool back: %s", error)

    def _compact(self, released_seq: int) -> None:
        """Drop the released lines from memory, and from the file once it pays (see MIN_COMPACTION_BYTES)."""
        num_released = 0
        while self._live and self._live[0].seq <= released_seq:
            self._live_bytes -= len(self._live.popleft().data)
            num_released += 1
        if num_released == 0:
            return
        if self._live_bytes < self._next_growth_log_bytes // 4:
            self._next_growth_log_bytes = max(GROWTH_LOG_FIRST_BYTES, self._next_growth_log_bytes // 2)
        if self._was_full and not self.is_full:
            self._was_full = False
            logger.info("usage spool %s has room again: new requests are served", self.path)
        released_bytes = self._file_bytes - self._live_bytes
        try:
            if not self._live:
                os.ftruncate(self._fd, 0)
                os.fsync(self._fd)
                self._file_bytes = 0
            elif released_bytes >= max(MIN_COMPACTION_BYTES, self._live_bytes):
                self._rewrite()
                os.close(self._fd)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError as error:  # the released lines stay in the file: read back, the table ignores them
            logger.warning("could not cut the usage spool %s: %s", self.path, error)

    def _rewrite(self) -> None:
        """Replace the file by the live lines: a temporary file, fsync'd, renamed over it, the folder fsync'd."""
        assert self.path is not None
        temporary = self.path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, b"".join(line.data for line in self._live))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        folder_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)
        self._file_bytes = self._live_bytes = sum(len(line.data) for line in self._live)

    def _log_growth(self) -> None:
        """A warning as the unwritten records pass 1 MiB and each doubling after; an error when the spool is full."""
        full = self.is_full
        if self._live_bytes < self._next_growth_log_bytes and not (full and not self._was_full):
            return
        self._was_full = full
        logger.log(
            logging.ERROR if full else logging.WARNING,
            "usage spool %s holds %d records (%.1f MiB of %.0f MiB) the database has not taken%s",
            self.path,
            len(self._live),
            self._live_bytes / 1024**2,
            self._max_bytes / 1024**2,
            ": full, new requests are refused until the database takes them" if full else "",
        )
        while self._next_growth_log_bytes <= self._live_bytes:
            self._next_growth_log_bytes *= 2


def _write_all(fd: int | None, data: bytes) -> None:
    assert fd is not None
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
