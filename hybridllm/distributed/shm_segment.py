"""Named POSIX shared-memory segments: private, pre-reserved, tracker-free, swept when stale."""

from __future__ import annotations

import _posixshmem  # what SharedMemory itself uses on POSIX; lets us skip its resource tracker
import errno
import mmap
import os
import stat
import uuid
from typing import NamedTuple

SEGMENT_PREFIX = "hybridllm_"
SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600  # only our uid may map a segment: its messages are unpickled


class SegmentCreator(NamedTuple):
    """Who created a segment, as recorded in its name by `new_segment_name`.

    `start_time` (clock ticks after boot, /proc/<pid>/stat field 22) tells a reused pid from
    the creator; `pid_namespace` (the inode of /proc/self/ns/pid) tells whether `pid` means
    the same process here: containers sharing /dev/shm see each other's segments but not
    each other's processes. Either is 0 when this machine has no procfs to read it from.
    """

    pid: int
    start_time: int
    pid_namespace: int


class SharedMemoryFullError(OSError):
    """/dev/shm has no room for a new segment (errno ENOSPC), with a message saying what to do."""


def _proc_stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None if no such process is visible."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after its last ')'
    return stat_line[stat_line.rfind(b")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot; None if it is not visible."""
    try:
        fields = _proc_stat_fields(pid)
    except OSError:
        return None
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def pid_namespace() -> int | None:
    """This process's pid-namespace id (an nsfs inode number), or None without procfs."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def this_creator() -> SegmentCreator:
    """This process as `new_segment_name` records it."""
    pid = os.getpid()
    return SegmentCreator(pid, process_start_time(pid) or 0, pid_namespace() or 0)


def creator_tag() -> str:
    """This process as `<pid>_<start time>_<pid namespace>`, for names that `creator_gone`
    can later judge (shared-memory segments, the message queue's socket directories)."""
    return "_".join(map(str, this_creator()))


def parse_creator_tag(tag: str) -> SegmentCreator | None:
    parts = tag.split("_")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    return SegmentCreator(*map(int, parts))


def new_segment_name() -> str:
    """A unique name that records its creator (pid first, so `hybridllm_<pid>_*` globs work)."""
    return f"{SEGMENT_PREFIX}{creator_tag()}_{uuid.uuid4().hex[:12]}"


def segment_creator(name: str) -> SegmentCreator | None:
    """The creator recorded by `new_segment_name`; None for any other name, including the
    older `hybridllm_<pid>_<hex>` names, which do not say which pid namespace `pid` is in."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    tag, _, suffix = name[len(SEGMENT_PREFIX) :].rpartition("_")
    return parse_creator_tag(tag) if suffix else None


def segment_creator_pid(name: str) -> int | None:
    """The pid in one of our names (current or older format), or None if not one of ours."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid, _, suffix = name[len(SEGMENT_PREFIX) :].partition("_")
    return int(pid) if pid.isdigit() and suffix else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine; a zombie (dead, not yet reaped
    by its parent) counts as dead, since it will never read or write again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    try:
        fields = _proc_stat_fields(pid)
    except OSError:
        return True
    if fields is None:  # it exited just now, unless there is no procfs at all
        return not os.path.isdir("/proc/self")
    return fields[:1] != [b"Z"]


def creator_gone(creator: SegmentCreator) -> bool:
    """Whether `creator` provably no longer runs: same pid namespace as ours, and its pid is
    free, a zombie, or taken by a process that started at another time (pid reuse)."""
    ours = pid_namespace()
    if ours is None or creator.pid_namespace != ours or creator.start_time == 0:
        return False  # its pid may name another process here, or we cannot tell
    try:
        fields = _proc_stat_fields(creator.pid)
    except OSError:
        return False
    if fields is None:
        return True
    return fields[0] == b"Z" or len(fields) <= 19 or int(fields[19]) != creator.start_time


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink our segments whose creator died without cleaning up (SIGKILL, SIGTERM, OOM).

    Called by the engine at start-up and by an executor after it kills workers. Removes
    only regular files owned by our uid, named by `new_segment_name` in our pid namespace,
    whose creator is provably gone (`creator_gone`). Everything else stays: another
    container's live engine (another pid namespace), other users' segments, and names in
    the older `hybridllm_<pid>_<hex>` format, which cannot say whose pid they hold (remove
    those by hand once no engine runs). Returns the names removed.
    """
    if not os.path.isdir(shm_dir):
        return []
    removed = []
    uid = os.geteuid()
    for name in sorted(os.listdir(shm_dir)):
        creator = segment_creator(name)
        if creator is None or not creator_gone(creator):
            continue
        path = os.path.join(shm_dir, name)
        if not owned_by(path, uid, stat.S_ISREG):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process cleaned it first
            continue
        removed.append(name)
    return removed


def owned_by(path: str, uid: int, is_kind) -> bool:
    """Whether `path` itself (not a symlink's target) is of the kind `is_kind` tests for
    (stat.S_ISREG, stat.S_ISDIR) and owned by `uid`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return is_kind(st.st_mode) and st.st_uid == uid


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (mappings stay valid until unmapped); False if already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


class MappedSegment:
    """A segment mapped into this process, never registered with multiprocessing's tracker.

    On Python < 3.13 `SharedMemory` registers every segment it opens with the resource
    tracker, which unlinks it when that process exits (destroying a writer's segment when a
    reader exits), and readers spawned from one parent share one tracker and race to
    unregister. Ownership here is explicit instead: close, finalizers, and
    `cleanup_stale_segments` for creators killed by a signal.
    """

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self._mmap = mapping
        self.buf = memoryview(mapping)
        self.name = name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def reserve_segment_pages(fd: int, size: int, name: str) -> None:
    """Allocate every page of the segment behind `fd` now, so that a full /dev/shm fails here
    with a clear error instead of killing the process with SIGBUS at some later write."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or size <= 0:
        return  # no way to reserve here (not Linux): pages are allocated on first touch
    try:
        fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise SharedMemoryFullError(errno.ENOSPC, _shm_full_message(name, size)) from None
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # the filesystem cannot reserve: same as before, pages come on first touch
        raise


def _shm_full_message(name: str, size: int) -> str:
    try:
        vfs = os.statvfs(SHM_DIR)
        free = f"{vfs.f_bavail * vfs.f_frsize} bytes are free of {vfs.f_blocks * vfs.f_frsize}"
    except OSError:
        free = "its free space is unknown"
    return (
        f"{SHM_DIR} is full: shared-memory segment {name!r} needs {size} bytes "
        f"({size / 2**20:.1f} MiB) and {free}. Free space there (look for leftover segments "
        f"with `ls -l {SHM_DIR}`) or make it larger; in a Docker container, start it with a "
        f"larger --shm-size (e.g. `docker run --shm-size=8g ...`; Docker's default is 64 MiB)"
    )


def create_segment(name: str, size: int) -> MappedSegment:
    """Create, size and map a new segment readable and writable by our uid only (0600).

    Its pages are reserved up front (`reserve_segment_pages`); on any failure the
    half-created segment is unlinked before the error propagates.
    """
    if size <= 0:
        raise ValueError(f"a shared-memory segment needs a positive size, got {size}")
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR  # O_EXCL: never adopt someone else's segment
    fd = _posixshmem.shm_open("/" + name, flags, mode=SEGMENT_MODE)
    try:
        os.ftruncate(fd, size)
        reserve_segment_pages(fd, size, name)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        unlink_segment(name)
        raise
    finally:
        os.close(fd)
    return MappedSegment(name, mapping)


def attach_segment(name: str) -> MappedSegment:
    """Map an existing segment (a reader's side); FileNotFoundError if it is gone."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=SEGMENT_MODE)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return MappedSegment(name, mapping)


def release_segment(segment: MappedSegment, owner: bool) -> None:
    """Finalizer: the owner unlinks (first: that is what matters), everyone unmaps."""
    if owner:
        unlink_segment(segment.name)
    try:
        segment.close()
    except BufferError:  # a caller still holds a chunk view; the mapping dies with the process
        pass
