"""``--what-if nodes=2,ranks_per_node=8,link_gbit=30[,...]``: a cluster, and optionally a target
device, to predict for.

Fields (``key=value``, comma-separated):

* ``nodes``, ``ranks_per_node``, ``link_gbit`` (required), ``latency_us``: the layout and the
  network between nodes.
* ``intra_gbit``: the in-node bandwidth (NVLink, PCIe...).  It replaces the measured in-node
  link and memory copy rate, which the hierarchical stages use.
* ``compute_ms``: forward + backward of one step on the target device.  The gradients'
  ready times are scaled with it (see :func:`target_profile`).
* ``update_ms``, ``fused_update_ms``: the optimizer's update on the target device, plain and
  fused.
* ``profile=PATH``: a profile file (:func:`read_profile`), written by ``aiakrun --advise`` on
  the target device (``AIAK_ADVISE_PROFILE_OUT``) or shipped (``profile=resnet50``, from
  ``aiak_training/advisor/profiles/``).  With it the script is not profiled here.

A profile file is JSON::

    {"format": "aiak-advise-profile", "version": 1,
     "device": "NVIDIA H100 80GB HBM3", "source": "how the figures were obtained",
     "ready_unit": "s" | "fraction_of_compute",
     "grads": [[bytes, ready], ...],     # in the order the gradients became ready
     "numels": [elements, ...],          # optional, one per gradient
     "call_s": 0.085 | null, "update_s": 0.001 | null, "fused_update_s": 0.0008 | null,
     "optimizer": "SGD"}

``ready`` is seconds since the step began (``"s"``, as a run records it) or a fraction of
the compute (``"fraction_of_compute"``, for a file not tied to one device, which then needs
``compute_ms``).  A ``null`` ``call_s`` or ``update_s`` must be given as ``compute_ms`` or
``update_ms``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from aiak_training.advisor.model import Profile

_REQUIRED = ("nodes", "ranks_per_node", "link_gbit")
_FIELDS = _REQUIRED + ("latency_us", "intra_gbit", "compute_ms", "update_ms",
                       "fused_update_ms", "profile")
PROFILE_FORMAT = "aiak-advise-profile"
PROFILE_VERSION = 1
READY_UNITS = ("s", "fraction_of_compute")
#: The shipped profiles: ``profile=NAME`` finds ``NAME.json`` here.
PROFILES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


class WhatIfError(ValueError):
    """A malformed --what-if; the message names the field."""


@dataclass(frozen=True)
class ProfileFile:
    """A profile file's contents (see the module docstring)."""

    device: str
    ready_unit: str
    grads: Tuple[Tuple[int, float], ...]
    numels: Tuple[int, ...] = ()
    call_s: Optional[float] = None
    update_s: Optional[float] = None
    fused_update_s: Optional[float] = None
    optimizer: str = ""
    source: str = ""
    path: str = ""


@dataclass(frozen=True)
class WhatIf:
    nodes: int
    ranks_per_node: int
    link_gbit: float
    latency_us: Optional[float] = None
    intra_gbit: Optional[float] = None
    compute_ms: Optional[float] = None
    update_ms: Optional[float] = None
    fused_update_ms: Optional[float] = None
    profile: Optional[str] = None
    #: The profile file read while parsing (``profile=``), so that a bad file is refused
    #: before anything runs.
    profile_file: Optional[ProfileFile] = field(default=None, compare=False, repr=False)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbit * 1e9 / 8

    @property
    def intra_bytes_per_s(self) -> Optional[float]:
        return None if self.intra_gbit is None else self.intra_gbit * 1e9 / 8

    @property
    def needs_script(self) -> bool:
        """Whether the script must be profiled here: not when a profile file is given."""
        return self.profile_file is None


def _int_field(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WhatIfError(f"field '{name}': expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise WhatIfError(f"field '{name}': expected a whole number >= 1, got {value}")
    return value


def _float_field(name: str, text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise WhatIfError(f"field '{name}': expected a number {bound}, got {text!r}")
    return value


def _resolve(path: str) -> str:
    """A path as given, or a shipped profile's name (``resnet50``)."""
    if os.path.exists(path) or os.sep in path or path.endswith(".json"):
        return path
    return os.path.join(PROFILES_DIR, path + ".json")


def _number(doc: Dict[str, Any], key: str, where: str, required: bool) -> Optional[float]:
    value = doc.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise WhatIfError(f"field 'profile': {where}: '{key}' must be a number >= 0"
                          f"{'' if required else ' or null'}, got {value!r}")
    return float(value)


def read_profile(path: str) -> ProfileFile:
    """Read and check a profile file; a :class:`WhatIfError` naming the field ``profile``
    and the file's key says what is wrong."""
    real = _resolve(path)
    where = path if real == path else f"{path} ({real})"
    try:
        with open(real, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        shipped = ", ".join(sorted(n[:-5] for n in os.listdir(PROFILES_DIR)
                                   if n.endswith(".json"))) if os.path.isdir(PROFILES_DIR) else ""
        raise WhatIfError(f"field 'profile': cannot read {where}: {exc.strerror or exc}"
                          f"{f' (shipped profiles: {shipped})' if shipped else ''}") from None
    except ValueError as exc:
        raise WhatIfError(f"field 'profile': {where} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise WhatIfError(f"field 'profile': {where}: not a profile file "
                          f"(no \"format\": \"{PROFILE_FORMAT}\")")
    if doc.get("version") != PROFILE_VERSION:
        raise WhatIfError(f"field 'profile': {where}: version {doc.get('version')!r}, this "
                          f"aiakrun reads version {PROFILE_VERSION}")
    unit = doc.get("ready_unit", "s")
    if unit not in READY_UNITS:
        raise WhatIfError(f"field 'profile': {where}: 'ready_unit' must be one of "
                          f"{', '.join(READY_UNITS)}, got {unit!r}")
    raw = doc.get("grads")
    grads: List[Tuple[int, float]] = []
    if not isinstance(raw, list) or not raw:
        raise WhatIfError(f"field 'profile': {where}: 'grads' must be a non-empty list of "
                          "[bytes, ready]")
    for i, g in enumerate(raw):
        ok = (isinstance(g, list) and len(g) == 2 and isinstance(g[0], int) and g[0] > 0
              and isinstance(g[1], (int, float)) and math.isfinite(g[1]) and g[1] >= 0
              and (unit == "s" or g[1] <= 1))
        if not ok:
            raise WhatIfError(f"field 'profile': {where}: 'grads'[{i}] must be [bytes > 0, "
                              f"ready >= 0{'' if unit == 's' else ' and <= 1'}], got {g!r}")
        grads.append((int(g[0]), float(g[1])))
    numels = doc.get("numels") or []
    if not isinstance(numels, list) or (numels and (
            len(numels) != len(grads) or
            not all(isinstance(n, int) and n > 0 for n in numels))):
        raise WhatIfError(f"field 'profile': {where}: 'numels' must list one element count "
                          "> 0 per gradient")
    return ProfileFile(device=str(doc.get("device") or "unnamed device"), ready_unit=unit,
                       grads=tuple(grads), numels=tuple(numels),
                       call_s=_number(doc, "call_s", where, required=False),
                       update_s=_number(doc, "update_s", where, required=False),
                       fused_update_s=_number(doc, "fused_update_s", where, required=False),
                       optimizer=str(doc.get("optimizer") or ""),
                       source=str(doc.get("source") or ""), path=real)


def profile_document(p: Profile, device: str, optimizer: str = "", source: str = ""
                     ) -> Dict[str, Any]:
    """A measured :class:`Profile` as a profile file's JSON (ready times in seconds)."""
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "device": device,
            "source": source, "ready_unit": "s",
            "grads": [[int(b), float(r)] for b, r in p.grads],
            "numels": [int(n) for n in p.grad_numels],
            "call_s": p.call_s, "update_s": p.update_s, "fused_update_s": p.fused_update_s,
            "optimizer": optimizer}


def write_profile(path: str, p: Profile, device: str, optimizer: str = "",
                  source: str = "") -> None:
    """Write ``p`` as a profile file (atomically)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(profile_document(p, device, optimizer, source), f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def parse_what_if(text: str) -> WhatIf:
    """Parse ``key=value`` pairs separated by commas; raise :class:`WhatIfError` naming the
    field that is unknown, repeated, missing or out of range (a profile file is read here,
    so a bad one is refused before anything runs)."""
    values: Dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise WhatIfError(f"field '{key}': expected {key}=VALUE")
        if key not in _FIELDS:
            raise WhatIfError(f"unknown field '{key}' (fields: {', '.join(_FIELDS)})")
        if key in values:
            raise WhatIfError(f"field '{key}' is given twice")
        values[key] = value.strip()
    for key in _REQUIRED:
        if key not in values:
            raise WhatIfError(f"field '{key}' is missing (required: {', '.join(_REQUIRED)})")

    def number(name: str, allow_zero: bool) -> Optional[float]:
        return None if name not in values else _float_field(name, values[name], allow_zero)

    path = values.get("profile")
    if path is not None and not path:
        raise WhatIfError("field 'profile': expected a file path or a shipped profile's name")
    w = WhatIf(nodes=_int_field("nodes", values["nodes"]),
               ranks_per_node=_int_field("ranks_per_node", values["ranks_per_node"]),
               link_gbit=_float_field("link_gbit", values["link_gbit"], allow_zero=False),
               latency_us=number("latency_us", allow_zero=True),
               intra_gbit=number("intra_gbit", allow_zero=False),
               compute_ms=number("compute_ms", allow_zero=False),
               update_ms=number("update_ms", allow_zero=True),
               fused_update_ms=number("fused_update_ms", allow_zero=True),
               profile=path, profile_file=None if path is None else read_profile(path))
    pf = w.profile_file
    if pf is not None:
        if w.compute_ms is None and (pf.call_s is None or pf.ready_unit != "s"):
            raise WhatIfError(f"field 'compute_ms' is missing: profile {path} gives no compute "
                              "time of its own (ready times as fractions, or call_s null)")
        if w.update_ms is None and pf.update_s is None:
            raise WhatIfError(f"field 'update_ms' is missing: profile {path} gives no update "
                              "time (update_s null)")
    return w


def target_profile(w: WhatIf, measured: Optional[Profile]) -> Tuple[Profile, List[str]]:
    """The step to predict with, and where each of its parts came from (for the header).

    The gradients (sizes, order, ready times) are the profile file's, else the ``measured``
    ones.  With ``compute_ms`` every ready time is scaled by ``compute_ms / compute`` of that
    source (a fraction of the compute is multiplied by ``compute_ms``): the assumption is that
    the target device runs each layer of forward and backward the same factor faster, so the
    gradients become ready at the same fractions of the compute.  ``update_ms`` and
    ``fused_update_ms`` replace the update times.  When only ``update_ms`` is given, the
    source's fused time is not kept (it is another device's) and the fused rows are left out.
    """
    pf = w.profile_file
    if pf is not None:
        base_grads: Sequence[Tuple[int, float]] = pf.grads
        numels = list(pf.numels)
        base_call, base_update, base_fused = pf.call_s, pf.update_s, pf.fused_update_s
        fraction = pf.ready_unit == "fraction_of_compute"
        origin = f"profile {w.profile} ({pf.device})"
    elif measured is not None:
        base_grads, numels = measured.grads, list(measured.grad_numels)
        base_call, base_update, base_fused = measured.call_s, measured.update_s, \
            measured.fused_update_s
        fraction = False
        origin = "measured here"
    else:
        raise ValueError("target_profile needs a profile file or a measured profile")
    mb = sum(b for b, _ in base_grads) / 1e6
    sources = [f"gradients: {len(base_grads)} tensor(s), {mb:.3g} MB, from {origin}"]
    if w.compute_ms is not None:
        call_s = w.compute_ms / 1e3
        if fraction:
            scale = call_s
            how = "ready times as its fractions of the compute"
        else:
            scale = call_s / base_call if base_call else 1.0
            how = f"ready times scaled by {scale:.3g} from {origin}'s compute"
        grads = [(b, r * scale) for b, r in base_grads]
        sources.append(f"compute: {w.compute_ms:g} ms given (compute_ms); {how}")
    else:
        assert base_call is not None and not fraction  # parse_what_if refused it otherwise
        call_s, grads = base_call, list(base_grads)
        sources.append(f"compute: from {origin}")
    if w.update_ms is not None:
        update_s = w.update_ms / 1e3
        sources.append(f"update: {w.update_ms:g} ms given (update_ms)")
    else:
        assert base_update is not None
        update_s = base_update
        sources.append(f"update: from {origin}")
    if w.fused_update_ms is not None:
        fused: Optional[float] = w.fused_update_ms / 1e3
        sources.append(f"fused update: {w.fused_update_ms:g} ms given (fused_update_ms)")
    elif w.update_ms is not None:
        fused = None
        sources.append("fused update: not given for the target (fused_update_ms); its rows "
                       "are left out")
    else:
        fused = base_fused
        sources.append(f"fused update: from {origin}" if fused is not None
                       else "fused update: none (no fused optimizer)")
    return Profile(grads=grads, call_s=call_s, update_s=update_s, fused_update_s=fused,
                   grad_numels=numels), sources
