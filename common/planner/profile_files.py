"""The local profile cache: ``$PDSERVE_CACHE/profiles/<key.slug()>.json``, one file per
``ProfileKey``, written by ``pdserve profile`` and by workers that measured themselves, read
by a worker at start so that a machine measures each (model, weights, threads, device) once.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from common.models.default_model import cache_dir
from common.planner.profile import ProfileKey, WorkerProfile

log = logging.getLogger(__name__)


def profile_path(key: ProfileKey, directory: Path | None = None) -> Path:
    """Where ``key``'s profile is cached (``directory`` default: $PDSERVE_CACHE/profiles)."""
    return (directory or cache_dir() / "profiles") / f"{key.slug()}.json"


def load_profile(key: ProfileKey, directory: Path | None = None) -> WorkerProfile | None:
    """The cached profile of ``key``; None when there is none, or the file cannot be read
    (another format, or another key under the same slug: it is measured again)."""
    path = profile_path(key, directory)
    try:
        profile = WorkerProfile.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("profile %s cannot be read (%s); it will be measured again", path, exc)
        return None
    return profile if profile.key == key else None


def save_profile(profile: WorkerProfile, directory: Path | None = None) -> Path:
    """Writes ``profile`` to its cache file, atomically (a reader sees the old file or the
    new one, never half of one); returns the path."""
    path = profile_path(profile.key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(profile.to_json())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path
