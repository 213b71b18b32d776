"""The files of a checkpoint on disk: the manifest (sizes and sha256 of every file),
fsync, atomic replace and removal, the sweep of temporary folders a killed save left,
and the disk-full message. `checkpoint.py` decides what goes in a checkpoint and when,
each backend's spec checks its own files (and what in them torch would unpickle); this
module only handles files."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from novarl.logging.console import info

STATE_FILE = "trainer_state.json"
"""Written last into a checkpoint: its presence marks the folder complete."""
MANIFEST_FILE = "manifest.json"
CHECKSUM = "sha256"
DISK_FULL_BELOW = 16 << 20
"""A write that fails with less free space than this (bytes) is reported as a full disk: torch's
writers do not always say so (a full disk can surface as "unexpected pos 704 vs 598")."""


def write_manifest(folder: Path, state_text: str) -> None:
    """manifest.json in `folder`: every file under it with its size and sha256 (each fsynced on
    the way, and every folder), and the sha256 of STATE_FILE, whose text will be `state_text`."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    digests = digest_all(files, sync=True)
    for sub in sorted({p.parent for p in files} | {folder}, key=lambda p: len(p.parts), reverse=True):
        fsync_path(sub)
    entries = {p.relative_to(folder).as_posix(): {"size": size, CHECKSUM: digest}
               for p, (size, digest) in zip(files, digests)}
    encoded = state_text.encode()
    entries[STATE_FILE] = {"size": len(encoded), CHECKSUM: hashlib.new(CHECKSUM, encoded).hexdigest()}
    write_synced(folder / MANIFEST_FILE, json.dumps({"format": 1, "files": entries}, indent=1))


def digest_all(files: list[Path], *, sync: bool = False) -> list[tuple[int, str]]:
    """(size, sha256) of each file, hashed in threads (hashlib and reads release the GIL)."""
    def digest(path: Path) -> tuple[int, str]:
        hasher, size = hashlib.new(CHECKSUM), 0
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                hasher.update(chunk)
                size += len(chunk)
            if sync:
                os.fsync(handle.fileno())
        return size, hasher.hexdigest()

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(files)))) as pool:
        return list(pool.map(digest, files))


def write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, and `folder` itself."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def replace_dir(new: Path, final: Path) -> None:
    """Put `new` at `final`; an older `final` is moved aside first, so a crash leaves
    either the old or the new folder at `final`, never a half-deleted one. The parent is
    fsynced after the rename (`new` must be synced by the caller)."""
    old = final.with_name(f".trash_{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    new.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Rename, then delete: a crash mid-delete never leaves a folder that passes as a checkpoint
    (the `.trash_` folder it leaves is swept at the next start)."""
    trash = path.with_name(f".trash_{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def discard_partial(partial: Path, err: BaseException, what: str, *, needed: str | None = None) -> str | None:
    """Remove the partial folder (or file) that a failed write left at `partial`. Returns what went
    wrong, for a UserError, when the OS refused the write (a full disk, no permission, an I/O error),
    or None for other failures (a bug, an interrupt: raise them as they are). needed: how much
    space the write takes, as the caller can tell."""
    free_at_failure = _free_bytes(partial.parent)
    written = tree_size(partial)
    _remove(partial)
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return None
    os_error = _os_error_in(err)
    full_errors = (errno.ENOSPC, errno.EDQUOT)
    full = ((os_error is not None and os_error.errno in full_errors)
            or any(os.strerror(code) in str(err) for code in full_errors)
            or (free_at_failure is not None and free_at_failure < DISK_FULL_BELOW))
    if full:
        need = needed or f"it needs more than the {megabytes(written)} written when the disk filled"
        return (f"{what} failed: the disk is full ({megabytes(_free_bytes(partial.parent))} free once the "
                f"partial copy was removed; {need}).")
    if os_error is not None:
        return f"{what} failed: {type(os_error).__name__}: {os_error}."
    return None


def _os_error_in(err: BaseException) -> OSError | None:
    """The first OSError behind `err`: its causes and contexts, a Ray task's cause, and the
    per-rank failures of torch.distributed.checkpoint's CheckpointException."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        todo += [current.__cause__, current.__context__, getattr(current, "cause", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def tree_size(path: Path) -> int:
    """Bytes in the files under `path` (0 when it does not exist)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def megabytes(size: int | None) -> str:
    return "an unknown amount" if size is None else f"{size / 1e6:.1f} MB"


def owner_tag() -> str:
    """`<host>-<pid>`: put in temporary names, so that a sweep can tell whether their writer is alive."""
    return f"{socket.gethostname()}-{os.getpid()}"


_TEMP = re.compile(r"^\.(?:tmp_step_\d+|.+\.tmp)(?:-(?P<owner>.+))?$")


def sweep_temp_folders(folder: Path, *, only: str | None = None) -> list[Path]:
    """Remove what killed writers left in `folder`: `.trash_*` (already deleted, whoever is
    at it) and temporary copies -- `.tmp_step_N-<host>-<pid>` (Checkpointer.save),
    `.<name>.tmp-<host>-<pid>` (save_atomically) -- whose process is gone. A temporary of a
    live process, or of another host (whose processes cannot be seen), is kept: checkpoint_dir
    may be shared. only: just those of the target named so (`.<only>.tmp-*`, `.trash_<only>`)."""
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        name = path.name
        if only is not None and name != f".trash_{only}" and not name.startswith(f".{only}.tmp-"):
            continue
        match = _TEMP.match(name)
        stale = name.startswith(".trash_") or (match is not None and not _owner_alive(match["owner"]))
        if stale:
            _remove(path)
            removed.append(path)
    if removed:
        info(f"removed {len(removed)} temporary folder(s) left by killed runs in {folder}: "
             f"{', '.join(sorted(p.name for p in removed))}")
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _owner_alive(owner: str | None) -> bool:
    """Whether the writer named by `<host>-<pid>` (or `<pid>`, or nothing: an older novarl) lives."""
    if owner is None:
        return False
    host, _, pid = owner.rpartition("-")
    if not pid.isdigit() or (host and host != socket.gethostname()):
        return bool(host)  # another host's: cannot tell, keep it
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


# ------------------------------------------------------------------ RNG
