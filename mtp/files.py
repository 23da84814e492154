"""Files written whole or not at all (issue 51): the one writer every
module of the project uses. Imports nothing of the project."""

from __future__ import annotations

import contextlib
import os
import tempfile


def _umask() -> int:
  """This process's umask, read without changing it where Linux tells it
  (/proc/self/status; briefly setting it would race other threads)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except (OSError, ValueError, IndexError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def write_atomic(path: str, data: str | bytes) -> str:
  """Writes ``data`` (str: UTF-8) to ``path`` whole or not at all: a
  temporary file in the same folder, written, flushed and fsynced, then
  renamed over ``path`` (a reader sees the old file or the new one; a
  failure, e.g. a full disk, leaves the old file and no temporary file).
  The file gets ``path``'s mode if it exists, else the umask's. Returns
  ``path``. Raises OSError naming ``path``."""
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  raw = data.encode("utf-8") if isinstance(data, str) else data
  try:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  except OSError as e:
    raise OSError(e.errno, e.strerror, path) from e
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(raw)
      f.flush()
      os.fsync(f.fileno())
    try:
      mode = os.stat(path).st_mode & 0o7777
    except OSError:
      mode = 0o666 & ~_umask()
    os.chmod(tmp, mode)
    os.replace(tmp, path)
  except BaseException as e:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    if isinstance(e, OSError) and e.filename != path:
      raise OSError(e.errno, e.strerror, path) from e
    raise
  with contextlib.suppress(OSError):      # the rename itself, durable (best effort)
    dfd = os.open(folder, os.O_RDONLY)
    try:
      os.fsync(dfd)
    finally:
      os.close(dfd)
  return path
