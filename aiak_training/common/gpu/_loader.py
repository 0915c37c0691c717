"""Loading a shared library once per process: the first candidate path that works wins, and
a failure is remembered with every path tried, so it is reported the same way each time."""
import ctypes
import threading
from typing import Callable, Generic, Iterable, List, Optional, Tuple, Type, TypeVar

T = TypeVar("T")


class LazyLibrary(Generic[T]):
    def __init__(self, candidates: Callable[[], Iterable[str]],
                 wrap: Callable[[ctypes.CDLL, str], T], errors: Tuple[Type[BaseException], ...],
                 failure: Callable[[List[str]], BaseException]):
        self._candidates, self._wrap, self._errors, self._failure = \
            candidates, wrap, errors, failure
        self._lock = threading.Lock()
        self._value: Optional[T] = None
        self._tried: Optional[List[str]] = None

    def get(self) -> T:
        """The wrapped library; raises ``failure(tried)`` if no candidate loads."""
        with self._lock:
            if self._value is None and self._tried is None:
                tried = []
                for path in self._candidates():
                    try:
                        self._value = self._wrap(ctypes.CDLL(path), path)
                        break
                    except (OSError, AttributeError) + self._errors as exc:
                        tried.append(f"{path}: {exc}")
                if self._value is None:
                    self._tried = tried
            if self._value is None:
                raise self._failure(self._tried or [])
            return self._value
