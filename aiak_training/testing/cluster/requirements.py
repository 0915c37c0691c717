"""What emulating a cluster needs: root and the tools (``ip``, ``tc``, ``unshare``,
``hostname``), found without running anything (:func:`static_requirements`)."""
from __future__ import annotations

import os
import shutil
import sys


def tool_paths() -> tuple[dict[str, str], list[str]]:
    """Absolute paths of the external tools, and the names of the missing ones."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    found: dict[str, str] = {}
    missing: list[str] = []
    for tool in ("ip", "tc", "unshare", "hostname"):
        path = shutil.which(tool, path=search)
        if path:
            found[tool] = path
        else:
            missing.append(tool)
    return found, missing


def static_requirements() -> str | None:
    """Reason the tool cannot work here without trying anything, or None."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return ("emulating a cluster needs root (it creates network namespaces, veth links "
                "and tc qdiscs); re-run as root")
    _, missing = tool_paths()
    if missing:
        return (f"required tools not found: {', '.join(missing)} "
                "(install iproute2 for ip/tc, util-linux for unshare, hostname)")
    return None
