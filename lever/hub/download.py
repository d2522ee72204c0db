"""One file over HTTP into the models folder: resumable, checked, and never left as if good.

The bytes go to FILE.part, which a later pull continues with a Range request (an interrupted
pull, Ctrl-C or a dropped connection, loses nothing it already wrote); a connection that drops
mid-body is resumed at once, and backs off only while no byte arrives. The file takes its name
only once its size and digest are the expected ones: a wrong digest removes the .part (its bytes
are not worth resuming) and says so in one line. One pull writes a .part at a time: a second
is refused, not interleaved. Plain urllib, so the catalogue's URLs need nothing installed; the
hub's own metadata and credentials come from lever.hub.hf.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import attrs

from lever.errors import LeverError
from lever.hub.store import Progress, file_digest, partial_path, quiet

CHUNK = 1 << 20


@attrs.frozen
class Digest:
    kind: str  # "sha256" or "git-sha1" (lever.hub.store.file_digest)
    hex: str


@attrs.frozen
class Transfer:
    """How patient a transfer is: retries without a byte between them, the pause before the
    k-th of those (k x pause_s), the socket timeout."""

    retries: int = 5
    pause_s: float = 0.5
    timeout_s: float = 30.0


class _Dropped(Exception):
    """The connection ended before the body did; `moved` says whether bytes came first."""

    def __init__(self, reason: str, moved: bool):
        super().__init__(reason)
        self.moved = moved


@contextlib.contextmanager
def locked(path: Path) -> Iterator[BinaryIO]:
    """`path` opened for appending, held by this process alone (a second pull of it is refused)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LeverError(f"{path}: another pull is writing it; wait for that one to end") from None
        yield f


def locked_part(dest: Path) -> contextlib.AbstractContextManager[BinaryIO]:
    """FILE.part, to append to, held by this process alone."""
    return locked(partial_path(dest))


def fetch(url: str, dest: Path, *, size: int | None, digest: Digest | None, headers: dict | None = None,
          progress: Progress = quiet, transfer: Transfer = Transfer()) -> Path:
    """`url`'s bytes as `dest`, continuing a FILE.part a previous fetch left; checked against
    `size` and `digest` (when given) before the file takes its name."""
    with locked_part(dest) as f:
        try:
            _transfer(url, f, size=size, headers=headers or {}, progress=progress, transfer=transfer,
                      label=dest.name)
        except BaseException:
            if f.tell() == 0:  # nothing to resume: no empty .part left to look like a pull under way
                partial_path(dest).unlink(missing_ok=True)
            raise
        f.flush()
        os.fsync(f.fileno())
        finish(partial_path(dest), dest, size=size, digest=digest, progress=progress)
    return dest


def finish(part: Path, dest: Path, *, size: int | None, digest: Digest | None, progress: Progress = quiet) -> None:
    """The .part becomes `dest` when its size and digest are right; else it is removed, in one line."""
    got = part.stat().st_size
    if size is not None and got != size:
        part.unlink()
        raise LeverError(f"{dest}: {got:,} bytes arrived where {size:,} were expected; the download was removed, "
                         "pull again")
    if digest is not None and (have := file_digest(part, digest.kind, progress)) != digest.hex:
        part.unlink()
        raise LeverError(f"{dest}: {digest.kind} {have} is not the expected {digest.hex}; the download was "
                         "removed (a changed or corrupt source), nothing was kept")
    os.replace(part, dest)


def _transfer(url: str, f: BinaryIO, *, size: int | None, headers: dict, progress: Progress, transfer: Transfer,
              label: str) -> None:
    failures, arrived = 0, False
    f.seek(0, os.SEEK_END)
    while size is None or f.tell() != size:
        if size is not None and f.tell() > size:  # a .part longer than the file: not this file's start
            _restart(f)
        try:
            _get(url, f, size=size, headers=headers, progress=progress, timeout_s=transfer.timeout_s, label=label)
            return
        except _Dropped as e:
            arrived = arrived or e.moved
            if not arrived:  # not one byte from it yet: the host is away now, not flaky
                raise LeverError(f"{url}: cannot reach it ({e}); check the network, then pull again") from None
            failures = 0 if e.moved else failures + 1
            if failures > transfer.retries:
                raise LeverError(f"{url}: the connection failed {failures} times at byte {f.tell():,} ({e}); pull "
                                 "again to resume from there") from None
            time.sleep(transfer.pause_s * failures)


def _restart(f: BinaryIO) -> None:
    f.seek(0)
    f.truncate()


def _get(url: str, f: BinaryIO, *, size: int | None, headers: dict, progress: Progress, timeout_s: float,
         label: str) -> None:
    """One GET from where the .part ends to the end of the file (or until the connection drops)."""
    have = f.tell()
    request = urllib.request.Request(url, headers={**headers, **({"Range": f"bytes={have}-"} if have else {})})
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        if e.code == 416:  # the .part is past the file's end: start over
            _restart(f)
            raise _Dropped("the server refused the range", moved=True) from None
        raise LeverError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise _Dropped(str(getattr(e, "reason", e)), moved=False) from None
    with response:
        if response.status == 206 and not response.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
            _restart(f)  # a range that is not the one asked for: from the start, next time
            raise _Dropped("the server answered another range", moved=True)
        if response.status != 206 and have:  # the server ignored the range and sent it all
            _restart(f)
            have = 0
        length = response.headers.get("Content-Length")
        end = have + int(length) if length and length.isdigit() else size
        _read_body(response, f, end=end, total=size or end, progress=progress, label=label)


def _read_body(response, f: BinaryIO, *, end: int | None, total: int | None, progress: Progress, label: str) -> None:
    moved = False
    while True:
        try:
            chunk = response.read(CHUNK)
        except (http.client.HTTPException, OSError) as e:
            raise _Dropped(f"{type(e).__name__}: {e}", moved=moved) from None
        if not chunk:
            break
        f.write(chunk)
        moved = True
        progress(label, f.tell(), total)
    if end is not None and f.tell() < end:  # http.client ends a short body quietly
        raise _Dropped(f"the connection closed at byte {f.tell():,} of {end:,}", moved=moved)
    if end is not None and f.tell() > end:
        raise LeverError(f"{response.url}: sent {f.tell():,} bytes, more than the {end:,} it announced")
