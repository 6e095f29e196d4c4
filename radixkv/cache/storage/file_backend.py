"""FileStorage: a directory of objects, one file per key, shared safely by several processes.

Layout: ``<root>/<first two hex digits of the key>/<key>``. A write goes to a temp file in the
same folder (a name no other writer uses: pid, thread and a counter) and is renamed over the
key (``os.replace``, atomic on POSIX), so a reader sees the old object, the new one, or none,
never a partial one. A reader that finds a file gone (another process's quota deletion) has a
miss. No fsync: after a power cut a renamed file may be empty or truncated; the object's
checksum (page_format.py) turns that into a miss and the file is deleted.

Quota (optional): at most about ``quota_bytes`` in objects. Reading a file refreshes its
modification time, so deleting by oldest mtime is LRU across every process sharing the folder.
Each instance estimates the folder's size (one scan, then its own writes); when the estimate
passes the quota it rescans (seeing the other processes' files too) and deletes the least
recently used objects down to 90% of it. Two processes may each overshoot by what they wrote
since their last scan, and both may delete the same file (the second gets "not found", fine).
Temp files a crashed writer left are deleted by a scan once older than ten minutes.

Planted entries. Only a regular file is an object: a directory, symlink, FIFO or device
where an object's file belongs (left by a careless tool or planted on purpose) is never read
through (the file is opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat``). It
is a miss, removed (a directory with everything under it) and counted in
``planted_objects``, never an outage; a write over one removes it first; a quota scan removes
those it meets.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from radixkv.cache.storage.backend import StorageBackend, StorageError

__all__ = ["FileStorage"]

_KEY = re.compile(r"[0-9a-f]{8,128}")
_LOW_WATER = 0.9  # a quota sweep deletes down to this fraction of the quota
_STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died
_counter = itertools.count()


def _error(e: OSError, what: str) -> StorageError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError("full", f"{what}: no space left on the device ({e})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StorageError("permission", f"{what}: permission denied ({e})")
    return StorageError("io", f"{what}: {e}")


class FileStorage(StorageBackend):
    """Objects as files under ``root`` (created on the first write).

    Args:
        root: the folder; several processes (and machines, on a shared filesystem with atomic
            rename) may use the same one.
        quota_bytes: keep the folder's objects under about this many bytes, deleting the least
            recently used; None: no limit.
    """

    def __init__(self, root: str | os.PathLike[str], *, quota_bytes: int | None = None) -> None:
        if quota_bytes is not None and (
            isinstance(quota_bytes, bool) or not isinstance(quota_bytes, int) or quota_bytes < 1
        ):
            raise ValueError(f"quota_bytes must be a positive int or None, got {quota_bytes!r}")
        self.root = Path(root).expanduser().absolute()
        self.url = f"file://{self.root}"
        self.quota_bytes = quota_bytes
        self._usage: int | None = None  # estimated bytes of objects (None: not scanned yet)
        self.evicted_objects = 0  # deleted by quota sweeps of this instance
        self.evicted_bytes = 0
        self.planted_objects = 0  # non-files found where objects belong (removed)

    def clone(self) -> FileStorage:
        return FileStorage(self.root, quota_bytes=self.quota_bytes)

    # ------------------------------------------------------------------ the interface
    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"storage keys are lowercase hex digests, got {key!r}")
        return self.root / key[:2] / key

    def _remove_planted(self, path: Path) -> None:
        """Remove the non-file at ``path`` (see "Planted entries"); counted."""
        self.planted_objects += 1
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)  # never follows the symlinks under it
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass  # not ours to remove (another owner, a read-only share): it stays a miss

    def _read(self, path: Path) -> bytes | None:
        """The object file at ``path``; None if there is none or a non-file (removed)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink
                self._remove_planted(path)
                return None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                fd = -1
                self._remove_planted(path)
                return None
            parts = []
            while chunk := os.read(fd, max(1, st.st_size + 1)):
                parts.append(chunk)
            return b"".join(parts)
        finally:
            if fd >= 0:
                os.close(fd)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                data = self._read(path)
            except OSError as e:
                raise _error(e, f"reading {path}") from e
            if data is None:
                out.append(None)
                continue
            # a read is a use: LRU order for quota sweeps (any process's); if it fails (deleted
            # meanwhile, a read-only share) the data read is still good
            with contextlib.suppress(OSError):
                os.utime(path)
            out.append(data)
        return out

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        written = 0
        for key, value in items:
            path = self._path(key)
            tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    view = memoryview(value)
                    while view:
                        view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                try:
                    os.replace(tmp, path)
                except OSError:
                    if stat.S_ISREG(os.lstat(path).st_mode):
                        raise
                    self._remove_planted(path)  # a directory in the way: see "Planted entries"
                    os.replace(tmp, path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)
                raise _error(e, f"writing {path}") from e
            written += len(value)
        if self.quota_bytes is not None and written:
            if self._usage is None:
                self._usage = self._scan()[0]
            else:
                self._usage += written
            if self._usage > self.quota_bytes:
                self.sweep()

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                raise _error(e, f"deleting {path}") from e

    # ------------------------------------------------------------------ quota
    def _scan(self) -> tuple[int, list[tuple[float, int, str]]]:
        """(total object bytes, [(mtime, size, path)] of every object); deletes stale temps."""
        total = 0
        files: list[tuple[float, int, str]] = []
        now = time.time()
        try:
            subdirs = [d for d in os.scandir(self.root) if d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0, []
        except OSError as e:
            raise _error(e, f"listing {self.root}") from e
        for d in subdirs:
            try:
                entries = list(os.scandir(d.path))
            except OSError:
                continue  # removed meanwhile, or unreadable: not ours to count
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    self._remove_planted(Path(e.path))
                    continue
                if e.name.startswith("."):
                    if now - st.st_mtime > _STALE_TEMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(e.path)
                    continue
                total += st.st_size
                files.append((st.st_mtime, st.st_size, e.path))
        return total, files

    def sweep(self) -> int:
        """Delete least recently used objects until the folder is under 90% of the quota;
        return how many bytes went (0 without a quota)."""
        if self.quota_bytes is None:
            return 0
        total, files = self._scan()
        target = int(self.quota_bytes * _LOW_WATER)
        freed = 0
        if total > self.quota_bytes:
            files.sort()
            for _, size, path in files:
                if total - freed <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass  # another process's sweep took it: it is gone either way
                except OSError as e:
                    raise _error(e, f"deleting {path}") from e
                freed += size
                self.evicted_objects += 1
        self.evicted_bytes += freed
        self._usage = total - freed
        return freed

    def usage_bytes(self) -> int:
        """Bytes of objects in the folder now (a scan)."""
        return self._scan()[0]
