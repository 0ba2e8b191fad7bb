"""How many intra-op threads a compiled model runs at, and running a call at that count.

Decode at batch 1 is hundreds of small parallel regions per token, each ending at an OpenMP barrier: when another
process holds one of the cores a region's threads need, every barrier waits for a thread the OS has descheduled,
and a 2-thread decode on 2 cores fell from 18.1 tokens/s (1 thread) to 1.6-3.2 (issue 49). So the default count is
what this process can have *now*:

- ``usable_cores``: the physical cores (SMT siblings counted once, from ``/sys/devices/system/cpu``) of the CPUs the
  process may run on (``os.sched_getaffinity``), capped by the cgroup CPU quota (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the tightest of the process's cgroup and its parents, rounded
  down: 2.5 CPUs of quota is 2 threads that never wait for the quota's next period).
- ``default_threads``: ``$OMP_NUM_THREADS`` when the user set it (their choice, as torch and OpenMP honour it);
  else ``usable_cores`` less the cores other processes keep busy over a short sample (``others_busy``: all CPU
  time in ``/proc/stat`` less this process's own), a core counted busy from ``BUSY`` of it; at least 1.
- ``resolve_threads``: a caller's ``threads=`` checked (a positive int), or ``default_threads()`` for None.
- ``running_at``: torch's intra-op count (``torch.set_num_threads``: OpenMP's and oneDNN's for the calling thread)
  set for the duration of a block and restored after, also on an exception; nothing done when it is already the
  count. It costs about 0.3 us per set. ``torch.set_num_threads`` also sets the count that threads starting torch
  work later inherit, so another Python thread's *first* torch call made inside the block starts at this count.

Input: the machine (affinity, ``/sys``, ``/proc``, the environment), a caller's count. Output: thread counts.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from precast.errors import PrecastError

BUSY = 0.25  # a core other processes keep busy this much of the sample (or more) is not ours to use
SAMPLE_S = 0.2  # how long default_threads() watches the machine
OMP_ENV = "OMP_NUM_THREADS"
CPU_SYS = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")


# ---- what this process may use --------------------------------------------------------------------------------
def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity; every CPU where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], sys_cpu: Path = CPU_SYS) -> int:
    """How many physical cores ``cpus`` span: SMT siblings (one ``core_cpus_list``, or ``thread_siblings_list``
    on older kernels) count once; a CPU whose topology the OS does not show counts as a core of its own."""
    cores: set[str] = set()
    for n in cpus:
        topology = sys_cpu / f"cpu{n}" / "topology"
        siblings = None
        for name in ("core_cpus_list", "thread_siblings_list"):
            with contextlib.suppress(OSError):
                siblings = (topology / name).read_text().strip()
                break
        cores.add(siblings or f"cpu{n}")
    return max(len(cores), 1)


def cgroup_cpus(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs the cgroup quota allows this process (quota / period), the tightest of its cgroup and their
    parents, v2 and v1; None when no quota is set or the files are not there."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max = "QUOTA PERIOD" or "max PERIOD"
            dirs = [root, root / "unified"]
            limits += [_v2_limit(d) for base in dirs for d in _upward(base, path)]
        elif "cpu" in controllers.split(","):
            dirs = [root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
            limits += [_v1_limit(d) for base in dict.fromkeys(dirs) for d in _upward(base, path)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _upward(base: Path, path: str) -> list[Path]:
    """``base/path`` and each parent up to ``base`` (a container sees its own cgroup as ``/``)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2_limit(folder: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0 and int(quota) > 0:
            return int(quota) / int(period)
    return None


def _v1_limit(folder: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError):
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    return None


def usable_cores() -> int:
    """Physical cores of the allowed CPUs, capped by the cgroup CPU quota (rounded down); at least 1."""
    cores = physical_cores(allowed_cpus())
    quota = cgroup_cpus()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(cores, 1)


def env_threads() -> int | None:
    """``$OMP_NUM_THREADS`` as the user set it (the first level of a nested list, ``4,2`` -> 4); None when unset.
    A value that is not a positive count is ignored with a warning, as torch and OpenMP ignore it."""
    text = os.environ.get(OMP_ENV, "").strip()
    if not text:
        return None
    first = text.split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    warnings.warn(f"${OMP_ENV}={text!r} is not a positive thread count; ignored", stacklevel=3)
    return None


# ---- what other processes take ---------------------------------------------------------------------------------
def cpu_seconds(stat: Path = PROC_STAT) -> tuple[float, float] | None:
    """(CPU seconds every process has used since boot, hypervisor steal included; CPU seconds this process and its
    waited-for children have used), or None where ``/proc/stat`` is not there. Their difference over a window is
    what other processes took meanwhile (a load average counts this process's own work too)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()[1:9]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    return (user + nice + system + irq + softirq + steal) / ticks, own


def others_busy(
    before: tuple[float, float] | None, after: tuple[float, float] | None, wall: float
) -> float | None:
    """The cores other processes kept busy on average between two ``cpu_seconds`` readings ``wall`` s apart."""
    if before is None or after is None or wall <= 0:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall)


def busy_now(sample_s: float = SAMPLE_S) -> float | None:
    """The cores other processes keep busy, watched for ``sample_s`` seconds (None: the OS cannot say)."""
    before, started = cpu_seconds(), time.perf_counter()
    time.sleep(sample_s)
    return others_busy(before, cpu_seconds(), time.perf_counter() - started)


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


# ---- the count --------------------------------------------------------------------------------------------------
def default_threads(*, busy: float | None = None) -> int:
    """The count a model runs at unless told: ``$OMP_NUM_THREADS`` when set, else the usable physical cores less
    those other processes keep busy now (``busy``: that figure, else sampled for ``SAMPLE_S``); at least 1."""
    env = env_threads()
    if env is not None:
        return env
    cores = usable_cores()
    if busy is None:
        busy = busy_now()
    if busy is None:  # no /proc/stat: the load average beyond this process's own (at most one running thread)
        busy = max(0.0, load_average() - 1.0)
    taken = math.ceil(busy - BUSY) if busy > BUSY else 0
    return max(1, cores - taken)


def resolve_threads(threads: int | None, where: str = "precast") -> int:
    """``threads`` checked (a positive int), or ``default_threads()`` when None."""
    if threads is None:
        return default_threads()
    return check_threads(threads, where)


def check_threads(threads: object, where: str) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise PrecastError(f"{where}: threads={threads!r}; give a positive int (or None for the default)")
    return threads


@contextlib.contextmanager
def running_at(threads: int) -> Iterator[None]:
    """torch's intra-op thread count at ``threads`` for the block, the caller's count restored after."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
