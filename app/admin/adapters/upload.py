"""Receiving an adapter upload: a multipart/form-data stream written part by part into a private folder.

Safe by construction:

- the body is parsed as it arrives (``multipart.PushMultipartParser``, the sans-IO parser Litestar itself
  uses); file bytes go to disk in blocks of at most ``WRITE_BLOCK_BYTES``, never a whole file in memory;
- a running count of file bytes across all parts stops the upload with 413 as soon as it passes the cap,
  and the body as a whole may exceed the cap only by ``MAX_FORM_OVERHEAD_BYTES`` (headers, boundaries,
  the text fields) and the chat files' own caps;
- only the parts ``name``, ``replace``, ``tool_call_format``, ``adapter_config.json``,
  ``adapter_model.safetensors``, ``chat_template.jinja`` and ``tokenizer_config.json`` are accepted, each
  once; the two adapter files are written under those fixed names, and a client's ``filename`` is never
  read, so nothing the client sends becomes a path; the chat files are small texts kept in memory, each
  under its own cap (their content is checked by app/admin/adapters/chat.py);
- the staging folder is a fresh random folder (mode 0700) under ``home/adapters/.uploads/`` and is
  removed when :func:`staged_upload`'s block ends, however it ends (what must survive is moved out first).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from multipart import MultipartError, MultipartSegment, ParserLimitReached, PushMultipartParser, parse_options_header

from app.adapters.store import ADAPTER_FILES
from app.tool_calls.templates import MAX_TEMPLATE_CHARS
from app.web.errors import ApiError, BadRequestError

logger = logging.getLogger(__name__)

NAME_FIELD, REPLACE_FIELD, FORMAT_FIELD = "name", "replace", "tool_call_format"
TEXT_FIELDS = (NAME_FIELD, REPLACE_FIELD, FORMAT_FIELD)
TEMPLATE_FILE, TOKENIZER_CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"
MAX_TEXT_FIELD_BYTES = 256  # a name is at most 64 characters; anything longer is not a name
# The chat files' caps: a template's characters take at most 4 bytes each in UTF-8 (its characters are
# counted once decoded); a tokenizer_config.json lists the added tokens too, ~1 MiB for the largest vocabularies.
MAX_CHAT_FILE_BYTES = {TEMPLATE_FILE: 4 * MAX_TEMPLATE_CHARS, TOKENIZER_CONFIG_FILE: 4 * 1024**2}
EXPECTED_PARTS = (NAME_FIELD, *ADAPTER_FILES, REPLACE_FIELD, FORMAT_FIELD, *MAX_CHAT_FILE_BYTES)
MAX_FORM_OVERHEAD_BYTES = 64 * 1024  # boundaries, part headers and text fields, on top of the file bytes
MAX_PART_HEADER_BYTES = 4096  # one part header line; a client's long filename must not grow memory
MAX_PARTS = len(EXPECTED_PARTS)  # a stream of more parts than the form has is refused while it is parsed
WRITE_BLOCK_BYTES = 1024**2  # file bytes gathered before one write, done off the event loop
MAX_ECHOED_PART_NAME = 80  # characters of an unexpected part's name repeated in the error
FORM_PARTS = (
    "the parts `name`, `adapter_config.json`, `adapter_model.safetensors` and optionally `replace`, "
    "`tool_call_format`, `chat_template.jinja` and `tokenizer_config.json`"
)
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


class UploadTooLargeError(ApiError):
    status = 413
    code = "upload_too_large"


@dataclass(frozen=True, slots=True)
class AdapterUpload:
    """A received upload: the form's fields, the folder holding its two files, and its chat files' texts."""

    name: str
    replace: bool
    folder: Path
    """Staging folder with exactly ``adapter_config.json`` and ``adapter_model.safetensors``."""
    num_file_bytes: int
    tool_call_format: str | None = None
    chat_files: dict[str, bytes] = field(default_factory=dict)
    """``chat_template.jinja`` and ``tokenizer_config.json`` as sent, those the form has (read after validation)."""


@asynccontextmanager
async def staged_upload(
    chunks: AsyncIterator[bytes],
    content_type: str | None,
    content_length: int | None,
    uploads_root: Path,
    max_file_bytes: int,
    check_name: Callable[[str], None],
) -> AsyncIterator[AdapterUpload]:
    """Receive the form into a new staging folder, yield it, and remove the folder when the block ends.

    ``check_name`` runs as soon as the ``name`` part is complete (raising to refuse it), so a bad name
    is answered before the files are read.
    """
    boundary = _boundary(content_type)
    max_body_bytes = max_file_bytes + MAX_FORM_OVERHEAD_BYTES + sum(MAX_CHAT_FILE_BYTES.values())
    if content_length is not None and content_length > max_body_bytes:
        raise _too_large(max_file_bytes)
    uploads_root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="upload-", dir=uploads_root))
    try:
        receiver = _FormReceiver(folder, max_file_bytes, check_name)
        yield await receiver.receive(chunks, boundary, max_body_bytes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # a moved folder is already gone; two files: quick


class _FormReceiver:
    """Feeds the stream to the parser and routes each part: text fields to memory, files to the folder."""

    def __init__(self, folder: Path, max_file_bytes: int, check_name: Callable[[str], None]) -> None:
        self.folder = folder
        self.max_file_bytes = max_file_bytes
        self.check_name = check_name
        self.texts: dict[str, str] = {}
        self.chat_files: dict[str, bytes] = {}
        self.files: set[str] = set()
        self.num_file_bytes = 0
        self._part: str | None = None
        self._text = bytearray()
        self._file: BinaryIO | None = None
        self._block = bytearray()

    async def receive(self, chunks: AsyncIterator[bytes], boundary: str, max_body_bytes: int) -> AdapterUpload:
        parser = PushMultipartParser(
            boundary, max_header_size=MAX_PART_HEADER_BYTES, max_segment_count=MAX_PARTS, strict=True
        )
        num_body_bytes = 0
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                num_body_bytes += len(chunk)
                if num_body_bytes > max_body_bytes:
                    raise _too_large(self.max_file_bytes)
                for event in parser.parse(chunk):
                    await self._on_event(event)
            parser.close()
        except ParserLimitReached as error:
            raise BadRequestError(
                f"The form is outside the limits of an adapter upload ({error}); send only {FORM_PARTS}.",
                param="multipart",
            ) from None
        except MultipartError as error:
            raise BadRequestError(
                f"The body is not a valid multipart/form-data stream ({error}); send the form with {FORM_PARTS}.",
                param="multipart",
            ) from None
        finally:
            if self._file is not None:
                self._file.close()
        return self._upload()

    async def _on_event(self, event: MultipartSegment | bytes | bytearray | None) -> None:
        if isinstance(event, MultipartSegment):
            self._start(event)
        elif event is None:
            await self._finish()
        elif self._file is not None:
            self.num_file_bytes += len(event)
            if self.num_file_bytes > self.max_file_bytes:
                raise _too_large(self.max_file_bytes)
            self._block += event
            if len(self._block) >= WRITE_BLOCK_BYTES:
                await self._flush()
        else:
            self._text += event
            self._check_text_size()

    def _check_text_size(self) -> None:
        name = self._part or ""
        if name in MAX_CHAT_FILE_BYTES:
            if len(self._text) > MAX_CHAT_FILE_BYTES[name]:
                fix = (
                    f"a chat template has at most {MAX_TEMPLATE_CHARS} characters"
                    if name == TEMPLATE_FILE
                    else f"send its chat template alone, as `{TEMPLATE_FILE}`"
                )
                raise BadRequestError(
                    f"The `{name}` part is larger than {MAX_CHAT_FILE_BYTES[name] // 1024} KiB; {fix}.", param=name
                )
        elif len(self._text) > MAX_TEXT_FIELD_BYTES:
            raise BadRequestError(
                f"The `{name}` field is longer than {MAX_TEXT_FIELD_BYTES} bytes; send a short text value.", param=name
            )

    def _start(self, segment: MultipartSegment) -> None:
        name = segment.name or ""
        if name not in EXPECTED_PARTS:
            shown = name[:MAX_ECHOED_PART_NAME] + ("…" if len(name) > MAX_ECHOED_PART_NAME else "")
            hint = (
                " (pickled weights are never accepted; send adapter_model.safetensors)" if name.endswith(".bin") else ""
            )
            raise BadRequestError(
                f"Unexpected form part {shown!r}{hint}; an adapter upload has only {FORM_PARTS}.", param=shown
            )
        if name in self.texts or name in self.files or name in self.chat_files:
            raise BadRequestError(f"The form has two `{name}` parts; send each part once.", param=name)
        self._part = name
        if name in TEXT_FIELDS or name in MAX_CHAT_FILE_BYTES:
            self._text = bytearray()
        else:
            # Fixed file names in a folder this process created: the client's filename is never used.
            self._file = (self.folder / name).open("xb")
            self._block = bytearray()

    async def _finish(self) -> None:
        name = self._part
        if self._file is not None:
            await self._flush()
            self._file.close()
            self._file = None
            self.files.add(name)
        elif name in MAX_CHAT_FILE_BYTES:
            self.chat_files[name] = bytes(self._text)
        elif name is not None:
            try:
                text = self._text.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise BadRequestError(f"The `{name}` field is not UTF-8 text.", param=name) from None
            self.texts[name] = text
            if name == NAME_FIELD:
                self.check_name(text)
        self._part = None

    async def _flush(self) -> None:
        if self._block and self._file is not None:
            block, self._block = bytes(self._block), bytearray()
            await asyncio.to_thread(self._file.write, block)

    def _upload(self) -> AdapterUpload:
        if NAME_FIELD not in self.texts:
            raise BadRequestError(f"The form has no `{NAME_FIELD}` field; name the adapter.", param=NAME_FIELD)
        for file_name in ADAPTER_FILES:
            if file_name not in self.files:
                raise BadRequestError(
                    f"The form has no `{file_name}` file part; a PEFT LoRA adapter is uploaded as "
                    f"{' and '.join(ADAPTER_FILES)} (the two files PEFT's save_pretrained writes).",
                    param=file_name,
                )
        return AdapterUpload(
            name=self.texts[NAME_FIELD],
            replace=_flag(self.texts.get(REPLACE_FIELD, "")),
            folder=self.folder,
            num_file_bytes=self.num_file_bytes,
            tool_call_format=self.texts.get(FORMAT_FIELD) or None,
            chat_files=self.chat_files,
        )


def _boundary(content_type: str | None) -> str:
    media_type, options = parse_options_header(content_type or "")
    boundary = options.get("boundary")
    if media_type != "multipart/form-data" or not boundary:
        raise BadRequestError(
            f"An adapter is uploaded as multipart/form-data (with a boundary), not {media_type or 'no content type'};"
            f" send {FORM_PARTS}.",
            param="content-type",
        )
    return boundary


def _flag(value: str) -> bool:
    word = value.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise BadRequestError(f"`{REPLACE_FIELD}` must be true or false, got {value[:20]!r}.", param=REPLACE_FIELD)


def _too_large(max_file_bytes: int) -> UploadTooLargeError:
    return UploadTooLargeError(
        f"The adapter upload is larger than the limit of {_size(max_file_bytes)} (LORAPLEX_MAX_ADAPTER_MB); "
        "upload a smaller adapter (a lower rank or fewer target modules) or ask the operator to raise the limit."
    )


def _size(num_bytes: int) -> str:
    if num_bytes >= 1024**2 and num_bytes % 1024**2 == 0:
        return f"{num_bytes // 1024**2} MiB"
    return f"{num_bytes} bytes"
