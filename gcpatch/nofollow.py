"""Opening a file under a directory without following a symbolic link another user owns.

A record directory may sit in a shared place (/tmp, a team volume). Another user who owns a link on
the way could send this user's records wherever they like: `a/blink/../rec` resolves through the
link, whatever the text says. So the path is walked the way the kernel walks it, one component at
a time, each opened relative to the directory opened before it (`dir_fd`) with O_NOFOLLOW: a link is
followed only where this user or root owns it (root's are the system's own: /var/run, macOS's
/tmp), and a directory swapped for a link between two decisions is met afresh at every open, with
no window between a check and the open. Missing directories are created 0700.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import deque

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MAX_LINKS = 40  # as the kernel's own limit (ELOOP)


class ForeignLink(OSError):
    """A component of the path is a symbolic link another user owns."""


def supported() -> bool:
    """Whether this platform opens relative to a directory (POSIX): elsewhere callers open as
    before."""
    return bool(_NOFOLLOW) and os.open in os.supports_dir_fd and os.mkdir in os.supports_dir_fd


def open_under(directory: str, name: str, flags: int, mode: int = 0o600) -> int:
    """A file descriptor of `name` inside `directory` (created with its missing parents), opened
    with `flags` | O_NOFOLLOW, reached through no link another user owns."""
    uid = os.getuid()
    start = directory if os.path.isabs(directory) else os.path.join(os.getcwd(), directory)
    parts = deque(start.split("/"))
    stack = [os.open("/", _DIR_FLAGS)]
    walked: list[str] = []  # the path as followed, for the error message
    links = 0
    try:
        while parts:
            part = parts.popleft()
            if part in ("", "."):
                continue
            if part == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    walked.pop()
                continue
            try:
                fd = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=stack[-1])
            except FileNotFoundError:
                fd = _made(part, stack[-1])
            except OSError as exc:
                shown = "/" + "/".join([*walked, part])
                _own_link(exc, part, stack[-1], shown, uid)
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"too many symbolic links at {shown}") from None
                target = os.readlink(part, dir_fd=stack[-1])
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                    walked.clear()
                parts.extendleft(reversed(target.split("/")))
                continue
            stack.append(fd)
            walked.append(part)
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


def _made(part: str, parent: int) -> int:
    """The directory `part` inside `parent`, made and opened."""
    try:
        os.mkdir(part, 0o700, dir_fd=parent)
    except FileExistsError:  # another rank made it between the open and here
        pass
    return os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=parent)


def _own_link(exc: OSError, part: str, parent: int, shown: str, uid: int) -> None:
    """Whether the open that raised `exc` met a symbolic link this user (or root) owns, which is
    followed; `exc` itself where it met no link, ForeignLink where another user owns it."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        raise exc
    info = os.stat(part, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        raise exc
    if info.st_uid not in (uid, 0):
        raise ForeignLink(
            errno.EPERM,
            f"{shown} is a symbolic link owned by another user (uid {info.st_uid}),"
            " which gcpatch never follows",
        ) from None
