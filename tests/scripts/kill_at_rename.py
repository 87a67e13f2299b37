"""Run the distill CLI and SIGKILL it at the K-th rename out of a StagedFiles staging folder.

    python kill_at_rename.py K distill-args...

K = 0 kills at the first rename; a K past the last rename lets the command finish. Used by
tests/test_atomic_writes.py to interrupt a heads save between any two of its renames.
"""

import os
import signal
import sys

K = int(sys.argv[1])
_real_replace = os.replace
_count = 0


def _replace(src, dst, *args, **kwargs):
    global _count
    if os.path.basename(os.path.dirname(os.fspath(src))).startswith(".staged."):
        if _count == K:
            os.kill(os.getpid(), signal.SIGKILL)
        _count += 1
    return _real_replace(src, dst, *args, **kwargs)


os.replace = _replace
sys.argv = ["distill", *sys.argv[2:]]
from distill.cli import main  # noqa: E402

main()
