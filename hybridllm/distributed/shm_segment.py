"""Named POSIX shared-memory segments: unique names, tracker-free attach, stale cleanup."""

from __future__ import annotations

import _posixshmem  # what SharedMemory itself uses on POSIX; lets readers skip its tracker
import mmap
import os
import sys
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

SEGMENT_PREFIX = "hybridllm_"
SHM_DIR = "/dev/shm"


def new_segment_name() -> str:
    """A name unique per run that records the creator's pid, for `cleanup_stale_segments`."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"


def segment_creator_pid(name: str) -> int | None:
    """The pid embedded by `new_segment_name`, or None if `name` is not one of ours."""
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
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:  # it exited just now, unless there is no procfs at all
        return not os.path.isdir("/proc/self")
    except OSError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink our segments whose creator died without cleaning up (SIGKILL, SIGTERM, OOM).

    Called by the engine at start-up and by an executor after it kills workers. A segment
    whose creator is alive is never touched. Returns the names removed.
    """
    if not os.path.isdir(shm_dir):
        return []
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        pid = segment_creator_pid(name)
        if pid is None or pid_alive(pid):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:  # another process cleaned it first
            continue
        removed.append(name)
    return removed


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (mappings stay valid until unmapped); False if already gone.

    Not SharedMemory.unlink: on Python < 3.13 it also unregisters from the resource
    tracker, which never knew the segment (see `create_segment`) and would print a KeyError.
    """
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


class AttachedSegment:
    """A reader's mapping of an existing segment, kept out of multiprocessing's resource_tracker.

    On Python < 3.13 `SharedMemory(name)` registers the segment with the resource tracker,
    which then unlinks it when the reader exits (destroying the writer's segment), and
    readers that share one tracker (spawned from one parent) cannot all unregister without
    racing. Readers therefore map the segment themselves, the way SharedMemory does.
    """

    def __init__(self, name: str) -> None:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def create_segment(name: str, size: int) -> SharedMemory:
    if sys.version_info >= (3, 13):
        return SharedMemory(name, create=True, size=size, track=False)
    segment = SharedMemory(name, create=True, size=size)
    # Ownership is explicit (close / finalizer / cleanup_stale_segments); the tracker would
    # only add a second, racy owner and "leaked" warnings.
    resource_tracker.unregister(getattr(segment, "_name", "/" + name), "shared_memory")
    return segment


def attach_segment(name: str) -> SharedMemory | AttachedSegment:
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)
    return AttachedSegment(name)


def release_segment(segment: SharedMemory | AttachedSegment, owner: bool) -> None:
    """Finalizer: the owner unlinks (first: that is what matters), everyone unmaps."""
    if owner:
        unlink_segment(segment.name)
    try:
        segment.close()
    except BufferError:  # a caller still holds a chunk view; the mapping dies with the process
        pass
