"""Helpers that make shim modules stand for aiak_training modules."""
import importlib
import sys


def _import_first(names):
    """Import the first of ``names`` that exists; re-raise real errors inside those modules."""
    last = None
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only "this module does not exist" moves on to the fallback; a missing dependency
            # inside an existing module (exc.name is something else) is a real error.
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise
            last = exc
            continue
        if getattr(module, "__file__", None) is None and hasattr(module, "__path__"):
            # An empty directory imports as a namespace package: nothing is implemented there.
            last = ImportError(f"{name} is an empty namespace package")
            continue
        return module
    raise ImportError(f"aiak-training provides none of {', '.join(names)} "
                      "(needed by the Horovod compatibility shim)") from last


def alias(shim_name, *targets):
    """Make ``import <shim_name>`` return the aiak_training module (same object, same state)."""
    module = _import_first(targets)
    sys.modules[shim_name] = module
    return module


def reexport(namespace, target, submodules=()):
    """Turn the shim package whose globals are ``namespace`` into a live view of ``target``.

    Attribute lookups go to the aiak_training module on every access (PEP 562), so nothing is
    copied and nothing can go stale.  ``submodules`` are the shim's own alias modules, imported
    on first attribute access as Horovod's package imports them eagerly.
    """
    impl = _import_first([target])
    shim_name = namespace["__name__"]

    def __getattr__(name):
        if name in submodules:
            return importlib.import_module(f"{shim_name}.{name}")
        if name == "__all__":
            return getattr(impl, "__all__", [n for n in dir(impl) if not n.startswith("_")])
        try:
            return getattr(impl, name)
        except AttributeError:
            raise AttributeError(f"module {shim_name!r} (aiak-training's {target}) has no "
                                 f"attribute {name!r}") from None

    def __dir__():
        return sorted(set(namespace) | set(dir(impl)) | set(submodules))

    namespace["__getattr__"] = __getattr__
    namespace["__dir__"] = __dir__
    return impl
