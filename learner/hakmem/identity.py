"""A program's identity: its executable and build, read from /proc/<pid>/exe.

Never from the telemetry file (its writer could claim anything). The build is
the ELF GNU build id when the executable has one; otherwise its size and
modification time, which change whenever the file is replaced.
"""
from __future__ import annotations

import os
import struct

NT_GNU_BUILD_ID = 3
PT_NOTE = 4


def elf_build_id(path: str) -> str | None:
    """The GNU build id of an ELF file as hex, or None."""
    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF":
                return None
            is64, little = ident[4] == 2, ident[5] == 1
            e = "<" if little else ">"
            if is64:
                phoff, = struct.unpack_from(e + "Q", ident, 32)
                phentsize, phnum = struct.unpack_from(e + "HH", ident, 54)
            else:
                phoff, = struct.unpack_from(e + "I", ident, 28)
                phentsize, phnum = struct.unpack_from(e + "HH", ident, 42)
            if phnum > 256 or phentsize < (56 if is64 else 32):
                return None
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            for i in range(phnum):
                ph = table[i * phentsize:(i + 1) * phentsize]
                if len(ph) < phentsize:
                    return None
                if struct.unpack_from(e + "I", ph, 0)[0] != PT_NOTE:
                    continue
                if is64:
                    off, = struct.unpack_from(e + "Q", ph, 8)
                    size, = struct.unpack_from(e + "Q", ph, 32)
                else:
                    off, = struct.unpack_from(e + "I", ph, 4)
                    size, = struct.unpack_from(e + "I", ph, 16)
                if size > 1 << 16:
                    continue
                f.seek(off)
                notes = f.read(size)
                pos = 0
                while pos + 12 <= len(notes):
                    namesz, descsz, ntype = struct.unpack_from(e + "III", notes, pos)
                    pos += 12
                    name = notes[pos:pos + namesz]
                    pos += (namesz + 3) & ~3
                    desc = notes[pos:pos + descsz]
                    pos += (descsz + 3) & ~3
                    if ntype == NT_GNU_BUILD_ID and name.rstrip(b"\0") == b"GNU" and desc:
                        return desc.hex()
    except (OSError, struct.error):
        return None
    return None


# File systems whose reads another user's process can stall at will (a FUSE
# server is an ordinary program); learnd never opens an executable on one.
STALLABLE = ("fuse", "fuseblk", "fuse.")


def _mount_of(pid: int, path: str) -> str | None:
    """The file system type of the mount that holds path, as process pid
    sees its mounts (/proc/<pid>/mountinfo: reading it touches no file
    system of the process's choosing)."""
    best, fstype = -1, None
    try:
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            for line in f:
                left, _, right = line.partition(b" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].decode("utf-8", "replace").replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > best:
                    best, fstype = len(mnt), right.split()[0].decode("utf-8", "replace")
    except OSError:
        return None
    return fstype


def program_identity(pid: int) -> tuple[str, str] | None:
    """(executable path, build identity) of a live process, or None if gone
    or not readable (another user's process when we are not root).

    readlink of /proc/<pid>/exe touches no file system; stat and open of it
    reach the executable's, which for a program run from a FUSE mount is
    another program that can stall them for ever. Such an executable is
    identified by its path alone ("unverified")."""
    link = f"/proc/{pid}/exe"
    try:
        exe = os.readlink(link)
    except OSError:
        return None
    exe = exe.removesuffix(" (deleted)")
    fstype = _mount_of(pid, exe)
    if fstype is None or fstype.startswith(STALLABLE):
        return exe, f"unverified:{fstype or 'unknown'}"
    try:
        st = os.stat(link)
    except OSError:
        return None
    bid = elf_build_id(link)
    return exe, bid if bid else f"stat:{st.st_size}:{int(st.st_mtime)}"
