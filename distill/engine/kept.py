"""Start-up measurements kept between runs: timed once per key, read back after.

What the engine times when it starts (the policy's step-cost curve, engine.costs; the single-row
kernel per weight shape, engine.cpu.linears) depends on the machine, torch, the thread count and the
shapes timed, not on one run, so it is kept as one JSON file per key under ``$DISTILL_HOME``, as
compilers keep their autotuning results. A kept file that cannot be read, or whose key differs (a
hash collision), is timed again and replaced, written whole or not at all: engines starting side
by side may both time it, and either file is right. A read-only home still runs: the measurement is
used, only not kept. Delete the folder to time everything again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable


def kept(folder: Path | None, key: dict, measure: Callable[[], dict]) -> tuple[dict, str | None]:
    """``measure()`` (a JSON-able dict) for ``key``, read from ``folder`` when timed before, else timed and kept there.

    Returns it and the file it was read from (None: timed now, or ``folder`` is None: timed every call).
    """
    if folder is None:
        return measure(), None
    blob = json.dumps(key, sort_keys=True, default=str)
    path = Path(folder) / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"
    try:
        doc = json.loads(path.read_text())
        if json.dumps(doc.pop("key"), sort_keys=True, default=str) == blob:
            return doc, str(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: timed below
    value = measure()
    from distill.store.atomic import atomic_write_json

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"key": json.loads(blob), **value})
    except OSError:
        pass
    return value, None
