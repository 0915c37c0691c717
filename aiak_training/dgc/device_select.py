"""DGC's selection in torch ops, on whatever device the gradient lives on, with no host sync.

The compiled kernels (:mod:`aiak_training.dgc._kernels`) serve CPU tensors; this module is
the implementation for every other device, and CI runs it on CPU tensors.  It selects by the
same total order as the kernels (larger ``|v|`` first, then the smaller index; zeros and NaN
never), so both return the same indices for the same tensor, whatever the sample.

Nothing in :func:`start` reads a device value on the host: every result has a size fixed in
advance, ``k`` index *slots* per tensor (ascending, then ``-1`` padding).  :func:`resolve`
reads the counts and "sample sufficed" flags of all tensors in one transfer (the step's one
host synchronisation) and only then runs the exact selection for the tensors whose sample
failed.

Sampled path (paper section 5), for all large, low-density tensors of one device and dtype
together, in a fixed number of ops whatever their number: their importances are
concatenated; each tensor's sample is blocks of 8 neighbours at evenly spaced positions with
a seeded offset, computed on the device (so no index tensor is copied from the host per
step); two stable sorts order every sample by (tensor, value), giving each tensor the
threshold that should pass about ``2k`` elements; the elements passing it are compacted into
``8k`` candidate slots per tensor; two more stable sorts take each tensor's exact top-k among
its candidates.  A tensor's sample fails when its threshold is zero, or fewer than ``k`` or
more than ``8k`` elements pass (heavy ties, mostly zeros).  Small or dense tensors take the
exact path (one ``topk`` each), as in the compiled kernels.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

# The same constants as the compiled kernels (csrc/dgc/module.cpp), so the two take the
# sampled path on the same tensors.
OVERSAMPLE = 2.0
MIN_SAMPLE_TOP = 32.0
BLOCK = 8
MIN_SAMPLED_N = 1 << 14
MAX_SAMPLED_DENSITY_INV = 16
CAP_FACTOR = 4.0          # candidate room: CAP_FACTOR * OVERSAMPLE * k (at least CAP_MIN)
CAP_MIN = 4096

# path codes, as select_topk reports them
PATH_EXACT = 0
PATH_SAMPLED = 1
PATH_FALLBACK = 4


def importance(v: torch.Tensor) -> torch.Tensor:
    """``|v|`` with NaN as 0, so NaN is never selected (a NaN compares false with ``> 0``)."""
    a = v.abs()
    return torch.where(a > 0, a, torch.zeros((), dtype=a.dtype, device=a.device))


def compact(mask: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` positions where ``mask`` is true, ascending, padded with -1."""
    if mask.device.type == "cpu":
        # The same result; on the host nonzero_static costs no synchronisation and is faster.
        return torch.nonzero_static(mask, size=size, fill_value=-1).view(-1)
    return compact_scatter(mask, size)


def compact_scatter(mask: torch.Tensor, size: int) -> torch.Tensor:
    """:func:`compact` from a cumulative sum and a scatter into a buffer with one spare slot:
    its size never depends on the data, so no device value is read on the host."""
    n = mask.numel()
    pos = mask.cumsum(0)
    spare = torch.full((), size, dtype=pos.dtype, device=pos.device)
    dest = torch.where(mask & (pos <= size), pos - 1, spare)
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, dest, torch.arange(n, device=mask.device))  # repeats land on the spare
    return out[:size]


def exact_slots(a: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k slots, count) of the exact top-``k`` of ``a`` (non-negative, zeros never chosen)."""
    kth = torch.topk(a, k, sorted=True).values[k - 1]
    greater = a > kth
    # Elements equal to the k-th value are ties: the ones with the smallest indices win.
    # When the k-th value is zero there are fewer than k non-zeros and ties are not taken.
    ties = (a == kth) & (kth > 0)
    need = k - greater.sum()
    chosen = greater | (ties & (ties.cumsum(0) <= need))
    return compact(chosen, k), chosen.sum()


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads consecutive seeds over the sample offsets."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


_SALT_BITS = 40  # salts below 2**40: their sums stay far from int64 overflow


def sample_blocks(n: int, k: int, sample_ratio: float) -> Optional[Tuple[int, int]]:
    """(blocks, spacing) of the sample of a tensor of ``n`` elements choosing ``k``, or None
    when the exact path is as cheap (the compiled kernels' rule, with their constants)."""
    if k <= 0 or k >= n or n < MIN_SAMPLED_N or k * MAX_SAMPLED_DENSITY_INV > n:
        return None
    density = k / n
    want = max(math.ceil(n * sample_ratio), math.ceil(MIN_SAMPLE_TOP / (OVERSAMPLE * density)))
    blocks = math.ceil(want / BLOCK)
    if blocks * BLOCK * 4 > n:
        return None
    return blocks, (n - BLOCK + 1) // blocks


class _Layout:
    """Device tensors describing one batch of sampled tensors, concatenated: made once per
    (shapes, k) and reused, since making them copies from the host and waits for the device.

    Tensor t occupies ``[start_t, start_t + n_t)`` of the flat importance, ``cap_t``
    candidate slots from ``cap_base_t``, and ``k_t`` output slots from ``slot_base_t``."""

    def __init__(self, numels: Sequence[int], ks: Sequence[int], sample_ratio: float,
                 device: torch.device):
        def dev(values):
            return torch.tensor(list(values), dtype=torch.int64, device=device)

        def prefix(values):
            out, total = [], 0
            for v in values:
                out.append(total)
                total += v
            return out, total
        T = len(numels)
        starts, self.n = prefix(numels)
        base, spacing, salt, samples, kth_at = [], [], [], [], []
        at = 0
        for t, (n, k) in enumerate(zip(numels, ks)):
            blocks, gap = sample_blocks(n, k, sample_ratio)
            s = blocks * BLOCK
            base += [starts[t] + j * gap for j in range(blocks)]
            spacing += [gap] * blocks
            salt += [_mix(t + 1) % (1 << _SALT_BITS)] * blocks
            samples.append(s)
            kth_at.append(at + math.ceil(OVERSAMPLE * (k / n) * s) - 1)
            at += s
        caps = [max(int(CAP_FACTOR * OVERSAMPLE * k), CAP_MIN) for k in ks]
        cap_base, self.cap_total = prefix(caps)
        slot_base, self.k_total = prefix(ks)
        self.slot_base = slot_base
        self.ks = list(ks)
        seg = torch.arange(T, device=device)
        self.block_base, self.block_spacing, self.block_salt = dev(base), dev(spacing), dev(salt)
        self.sample_seg = torch.repeat_interleave(seg, dev(samples), output_size=at)
        self.kth_at = dev(kth_at)
        self.numel = dev(numels)
        self.flat_seg = torch.repeat_interleave(seg, self.numel, output_size=self.n)
        self.seg_start, self.seg_end = dev(starts), dev([a + b for a, b in zip(starts, numels)])
        self.k, self.cap, self.cap_base = dev(ks), dev(caps), dev(cap_base)
        self.cand_seg = torch.repeat_interleave(seg, self.cap, output_size=self.cap_total)
        # Candidate slot p's rank inside its tensor's block, and whether the top k_t take it.
        rank = torch.arange(self.cap_total, device=device) - self.cap_base[self.cand_seg]
        self.cand_taken = rank < self.k[self.cand_seg]
        self.slot_seg_base = dev(slot_base)[self.cand_seg]
        self.slot_offset = torch.repeat_interleave(self.seg_start, self.k, output_size=self.k_total)


_LAYOUTS: Dict[Any, _Layout] = {}


def _layout(numels: Sequence[int], ks: Sequence[int], sample_ratio: float,
            device: torch.device) -> _Layout:
    key = (str(device), tuple(numels), tuple(ks), sample_ratio)
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 8:  # a few densities/models at a time; never grows without bound
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(numels, ks, sample_ratio, device)
    return layout


def _segment_sums(flags: torch.Tensor, layout: _Layout) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inclusive running count of ``flags``, per-tensor totals) over the flat layout."""
    run = flags.cumsum(0)
    padded = torch.cat([run.new_zeros(1), run])
    return run, padded[layout.seg_end] - padded[layout.seg_start]


def _scatter_slots(keep: torch.Tensor, dest: torch.Tensor, size: int,
                   values: torch.Tensor) -> torch.Tensor:
    """``out[dest[i]] = values[i]`` where ``keep``, into ``size`` slots padded with -1 (the
    others go to a spare slot, dropped)."""
    spare = torch.full((), size, dtype=torch.int64, device=dest.device)
    out = torch.full((size + 1,), -1, dtype=torch.int64, device=dest.device)
    out.scatter_(0, torch.where(keep, dest, spare), values)
    return out[:size]


def _sampled_batch(vs: Sequence[torch.Tensor], layout: _Layout, seed: int
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled selection of every tensor of a batch at once, in a fixed number of ops.

    Returns (``k_total`` slots of tensor-local indices, per tensor: whether the sample
    sufficed, how many non-zeros it has)."""
    device = vs[0].device
    a = importance(torch.cat([v.reshape(-1) for v in vs]))
    step_salt = _mix(seed) % (1 << _SALT_BITS)
    offset = (layout.block_salt + step_salt) % layout.block_spacing
    pos = ((layout.block_base + offset).unsqueeze(1)
           + torch.arange(BLOCK, device=device)).reshape(-1)
    # Each tensor's sample in descending order: a stable sort by value, then by tensor.
    values, by_value = torch.sort(a.index_select(0, pos), descending=True, stable=True)
    _, by_seg = torch.sort(layout.sample_seg.index_select(0, by_value), stable=True)
    threshold = values.index_select(0, by_seg).index_select(0, layout.kth_at)
    thr = threshold.index_select(0, layout.flat_seg)
    passing = (a >= thr) & (thr > 0)
    run, passed = _segment_sums(passing, layout)
    # The candidates of tensor t, ascending, into its cap_t slots (overflow is dropped and
    # flags the tensor).
    before = (run - passing.to(run.dtype)).index_select(0, layout.seg_start)
    rank = run - before.index_select(0, layout.flat_seg)  # 1-based among the tensor's passers
    seg_cap = layout.cap.index_select(0, layout.flat_seg)
    dest = layout.cap_base.index_select(0, layout.flat_seg) + rank - 1
    cand = _scatter_slots(passing & (rank <= seg_cap), dest, layout.cap_total,
                          torch.arange(layout.n, device=device))
    # The exact top-k_t among each tensor's candidates, by (|v| desc, index asc): a stable
    # sort by value, then by tensor; the first k_t of each tensor's block are taken.
    zero = torch.zeros((), dtype=a.dtype, device=device)
    ca = torch.where(cand >= 0, a.index_select(0, cand.clamp(min=0)), zero)
    _, by_value = torch.sort(ca, descending=True, stable=True)
    _, by_seg = torch.sort(layout.cand_seg.index_select(0, by_value), stable=True)
    order = by_value.index_select(0, by_seg)
    taken = torch.zeros(layout.cap_total, dtype=torch.bool, device=device)
    taken.scatter_(0, order, layout.cand_taken)
    # ... and written, ascending, into the tensor's k_t output slots.
    trun = taken.cumsum(0)
    tbefore = (trun - taken.to(trun.dtype)).index_select(0, layout.cap_base)
    trank = trun - tbefore.index_select(0, layout.cand_seg)
    picked = _scatter_slots(taken, layout.slot_seg_base + trank - 1, layout.k_total, cand)
    local = torch.where(picked >= 0, picked - layout.slot_offset, picked)
    ok = (threshold > 0) & (passed >= layout.k) & (passed <= layout.cap)
    _, nonzeros = _segment_sums(a > 0, layout)
    return local, ok, nonzeros


class Pending(NamedTuple):
    """Selections started by :func:`start`, to be finished by :func:`resolve`."""
    vs: List[torch.Tensor]
    ks: List[int]
    exact: List[Tuple[int, torch.Tensor, torch.Tensor]]    # (tensor, slots, count)
    batches: List[Tuple[List[int], _Layout, torch.Tensor, torch.Tensor, torch.Tensor]]


def start(vs: Sequence[torch.Tensor], ks: Sequence[int], *, exact: bool = False,
          sample_ratio: float = 0.01, seed: int = 0) -> Pending:
    """Start the top-``k`` selection of ``|v|`` for every tensor (1-D, float), on their
    devices, reading nothing on the host.

    Tensors that sample (large, low density) are selected together, one batch per device
    and dtype, in a fixed number of ops whatever their number; the others take the exact
    path one by one."""
    vs = list(vs)
    ks = [int(min(max(k, 1), v.numel())) for v, k in zip(vs, ks)]
    exact_sel, groups = [], {}
    for t, (v, k) in enumerate(zip(vs, ks)):
        if exact or sample_blocks(v.numel(), k, sample_ratio) is None:
            slots, count = exact_slots(importance(v), k)
            exact_sel.append((t, slots, count))
        else:
            groups.setdefault((str(v.device), v.dtype), []).append(t)
    batches = []
    for members in groups.values():
        layout = _layout([vs[t].numel() for t in members], [ks[t] for t in members],
                         sample_ratio, vs[members[0]].device)
        local, ok, nonzeros = _sampled_batch([vs[t] for t in members], layout, seed)
        batches.append((members, layout, local, ok, nonzeros))
    return Pending(vs, ks, exact_sel, batches)


def resolve(pending: Pending) -> Tuple[List[torch.Tensor], List[int], List[int]]:
    """Finish the selections: (k slots, count, path) per tensor, in order.

    Reads every count and flag in one transfer (the step's one host synchronisation), then
    runs the exact selection for tensors whose sample failed; their count is known without
    another transfer, min(k, non-zeros)."""
    parts = [count.reshape(1) for _, _, count in pending.exact]
    for _, _, _, ok, nonzeros in pending.batches:
        parts += [ok.to(torch.int64), nonzeros.to(torch.int64)]
    if not parts:
        return [], [], []
    host = torch.cat([p.to(device=parts[0].device) for p in parts]).tolist()
    n = len(pending.vs)
    slots: List[Optional[torch.Tensor]] = [None] * n
    counts, paths = [0] * n, [PATH_EXACT] * n
    for j, (t, s, _) in enumerate(pending.exact):
        slots[t], counts[t] = s, host[j]
    at = len(pending.exact)
    for members, layout, local, _, _ in pending.batches:
        m = len(members)
        flags, nonzeros = host[at: at + m], host[at + m: at + 2 * m]
        at += 2 * m
        for j, t in enumerate(members):
            k = pending.ks[t]
            if flags[j]:
                base = layout.slot_base[j]
                slots[t], counts[t], paths[t] = local[base: base + k], k, PATH_SAMPLED
            else:
                slots[t], _ = exact_slots(importance(pending.vs[t]), k)
                counts[t], paths[t] = min(k, nonzeros[j]), PATH_FALLBACK
    return slots, counts, paths  # type: ignore[return-value]


__all__ = ["Pending", "start", "resolve", "exact_slots", "compact", "compact_scatter",
           "importance", "sample_blocks"]
