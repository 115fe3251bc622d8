"""The telemetry directory's lease: processes publish only while a reader holds it.

A process makes its telemetry file only while somebody will read it, so that
without hakmem-learnd nothing accumulates in the directory (a file is about
1 MiB of RAM, and a process ended by _exit or a signal leaves its file behind).
The reader that holds the lease is hakmem-learnd, or `hakmem ring watch` /
`hakmem ring hold` when a person reads the files by hand.

CONTRACT (the other side: allocator/src/telemetry.c, lease_held)
 1. The lease is the file `learnd.lock` in the telemetry directory.
 2. It is held while an open-file-description write lock (F_OFD_SETLK,
    F_WRLCK) covers the whole file. OFD locks belong to the open file, not to
    the process: a holder that is itself preloaded with hakmem does not lose
    its lock when the allocator opens and closes the file to look at it
    (a POSIX fcntl lock would be dropped by that close).
 3. The allocator believes a lease only when the file is a regular file
    with one name, owned by root or by the process's own effective user; it
    tests for a write lock with F_OFD_GETLK and never takes one. The holder
    writes only into a file it created or that passes the same checks (a
    hard link to another file of its owner is replaced, never written).
 4. Only the file's owner can open it for writing, so only the owner can
    hold the lease. The file is created 0600, locked, and only then made
    0644: nobody can open a fresh file to take a read lock on it first.
 5. A read lock held by anybody else (a squatter who opened an old 0644 file
    read-only) does not hold the lease; the holder-to-be replaces the file.
 6. The file holds one line for people: what holds the lease, and its pid.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct

NAME = "learnd.lock"
# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid.
_FLOCK = "hhqqi4x"


class LeaseError(Exception):
    """The lease cannot be taken, with the reason in one line."""


class LeaseHeld(LeaseError):
    """Another reader holds the lease."""


def _flock(kind):
    return struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0)


def _try_lock(fd) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _lock_kind(fd) -> int:
    """F_UNLCK, F_RDLCK or F_WRLCK: the strongest lock another description holds."""
    out = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK))
    return struct.unpack(_FLOCK, out)[0]


def holder(directory) -> str | None:
    """What holds the lease on directory (its line), or None when nobody does."""
    try:
        fd = os.open(os.path.join(directory, NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_nlink != 1:
            return None
        if struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_RDLCK)))[0] != fcntl.F_WRLCK:
            return None
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a reader"
    finally:
        os.close(fd)


class Lease:
    """Holds the lease on a telemetry directory for as long as it is open."""

    def __init__(self, directory, what="hakmem-learnd"):
        self.directory = os.path.abspath(directory)
        self.what = what
        self.fd = -1
        self.ident = None

    def acquire(self) -> "Lease":
        try:
            dfd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise LeaseError(f"cannot open the telemetry directory {self.directory}: {e.strerror}") from None
        try:
            for _ in range(5):
                if self._take_existing(dfd) or self._create(dfd):
                    return self
            raise LeaseError(f"{self.directory}/{NAME} keeps changing under us; another program is racing for it")
        finally:
            os.close(dfd)

    def _take_existing(self, dfd) -> bool:
        """True when the existing file is ours and now locked; False when
        there is none (any more): create one. Raises when it cannot be had."""
        try:
            fd = os.open(NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            return False
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO, errno.EISDIR):
                raise LeaseError(f"cannot open {self.directory}/{NAME}: {e.strerror}") from None
            self._raise_if_held(dfd)
            return self._replace(dfd, why=e.strerror)
        st = os.fstat(fd)
        # A file with another name too could be anybody's file of ours that
        # somebody linked here (fs.protected_hardlinks=0): never written.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1 or st.st_size > 4096:
            os.close(fd)
            return self._replace(dfd, why="not a lease file of ours")
        if _try_lock(fd):
            self._own(fd)
            return True
        held = _lock_kind(fd) == fcntl.F_WRLCK
        os.close(fd)
        if held:
            self._raise_if_held(dfd)
        return self._replace(dfd, why="read-locked by another program")   # a squatter on an old file

    def _raise_if_held(self, dfd):
        """Raises LeaseHeld when a regular file under the name is write-locked
        (only its owner can have done that: it is a real holder)."""
        try:
            fd = os.open(NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) or _lock_kind(fd) != fcntl.F_WRLCK:
                return
            line = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another reader"
        finally:
            os.close(fd)
        raise LeaseHeld(f"{line} already holds {self.directory} (its {NAME} is locked)")

    def _replace(self, dfd, why) -> bool:
        """Removes a file we cannot use as the lease, when we may."""
        try:
            st = os.stat(NAME, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        try:
            os.unlink(NAME, dir_fd=dfd)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise LeaseError(f"{self.directory}/{NAME} ({why}, uid {st.st_uid}) cannot be replaced: "
                             f"{e.strerror}") from None
        return False

    def _create(self, dfd) -> bool:
        try:
            fd = os.open(NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except FileExistsError:
            return False
        except OSError as e:
            raise LeaseError(f"cannot create {self.directory}/{NAME}: {e.strerror}") from None
        if not _try_lock(fd):     # nobody else can open a 0600 file of ours: cannot happen
            os.close(fd)
            return False
        self._own(fd)
        return True

    def _own(self, fd):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.what} (pid {os.getpid()})\n".encode(), 0)
        os.fchmod(fd, 0o644)
        st = os.fstat(fd)
        self.fd, self.ident = fd, (st.st_dev, st.st_ino)

    def held(self) -> bool:
        """Whether the name still leads to our locked file (root may have
        replaced a user's lease, or somebody removed the directory)."""
        if self.fd < 0:
            return False
        try:
            st = os.stat(os.path.join(self.directory, NAME), follow_symlinks=False)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def release(self):
        if self.fd < 0:
            return
        if self.held():
            try:
                os.unlink(os.path.join(self.directory, NAME))
            except OSError:
                pass
        os.close(self.fd)
        self.fd, self.ident = -1, None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
