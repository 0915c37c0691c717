"""Process-wide "say it once" helpers for notices that would otherwise repeat every step."""
import threading
import warnings

_warned: set = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Issue ``message`` as a RuntimeWarning the first time ``key`` is seen in this process
    (attributed to the caller's caller)."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
