"""Dropping a small JSON record into aiakrun's failure directory (``$AIAK_FAILURE_DIR``).

Ranks, their wrappers and the watchdog all leave records there for aiakrun's failure summary.
Standard library only: the rank wrapper imports it before any framework.
"""
import json
import os
from typing import Any, Dict


def drop_record(directory: str, name: str, suffix: str, record: Dict[str, Any]) -> None:
    """Write ``record`` as ``directory/name + suffix``, all at once for readers (written to a
    hidden temporary file, then renamed).  Does nothing when ``directory`` is not there: the
    rank then runs on another host, where aiakrun could not read the file anyway; a write
    that fails is dropped too, since a report must never fail the job."""
    if not directory or not os.path.isdir(directory):
        return
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(directory, name + suffix))
    except OSError:
        pass
