"""What this process has open, as /proc/self/fd shows it.

An anonymous FileBacked has no name in its directory; its ``filename`` is what
the kernel calls the open file ('/tmp/#1234 (deleted)'), which is what these
helpers compare with.
"""

from __future__ import annotations

import os


def open_files() -> set:
    """The targets of this process's open file descriptors."""
    fds = "/proc/self/fd"
    out = set()
    for fd in os.listdir(fds):
        try:
            out.add(os.readlink(os.path.join(fds, fd)))
        except OSError:  # closed meanwhile
            pass
    return out


def is_open(filename: str) -> bool:
    """Whether this process has `filename` open."""
    return filename in open_files()
