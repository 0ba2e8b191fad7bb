"""The thread count a compiled model runs at (issue 49 item 3): the default from the cores this process may use
(physical cores of its affinity, the cgroup quota, ``$OMP_NUM_THREADS``) less those other processes keep busy, and
a count set for one call and restored after. The machine is stubbed: affinity, ``/sys``, ``/proc``, the load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from precast.errors import PrecastError
from precast.runtime import threads as rt


def topology(root: Path, siblings: dict[int, str]) -> Path:
    """A fake ``/sys/devices/system/cpu``: ``siblings[cpu]`` is its ``core_cpus_list``."""
    for n, text in siblings.items():
        folder = root / f"cpu{n}" / "topology"
        folder.mkdir(parents=True)
        (folder / "core_cpus_list").write_text(text + "\n")
    return root


def test_smt_siblings_count_once(tmp_path):
    sys_cpu = topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})  # 2 cores, 2 threads each
    assert rt.physical_cores({0, 1, 2, 3}, sys_cpu) == 2
    assert rt.physical_cores({0, 2}, sys_cpu) == 1  # affinity on one core's two siblings
    assert rt.physical_cores({0, 1}, sys_cpu) == 2
    # an older kernel names the file thread_siblings_list; a CPU the OS shows nothing for is a core of its own
    old = tmp_path / "old" / "cpu0" / "topology"
    old.mkdir(parents=True)
    (old / "thread_siblings_list").write_text("0-1\n")
    assert rt.physical_cores({0, 1}, tmp_path / "old") == 2  # cpu1 unknown: counted alone
    assert rt.physical_cores({0}, tmp_path / "old") == 1


def cgroup_file(root: Path, rel: str, name: str, text: str) -> None:
    folder = root / rel
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text + "\n")


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_parents(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/box\n")
    root = tmp_path / "fs"
    cgroup_file(root, "pod/box", "cpu.max", "max 100000")  # no limit here
    cgroup_file(root, "pod", "cpu.max", "150000 100000")  # 1.5 CPUs on the parent
    assert rt.cgroup_cpus(proc, root) == 1.5
    cgroup_file(root, "pod/box", "cpu.max", "50000 100000")
    assert rt.cgroup_cpus(proc, root) == 0.5
    cgroup_file(tmp_path / "none", "", "cpu.max", "max 100000")
    assert rt.cgroup_cpus(proc, tmp_path / "none") is None
    assert rt.cgroup_cpus(tmp_path / "absent", root) is None  # no /proc/self/cgroup


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/x\n0::/\n")
    root = tmp_path / "fs"
    cgroup_file(root, "cpu,cpuacct/x", "cpu.cfs_quota_us", "300000")
    cgroup_file(root, "cpu,cpuacct/x", "cpu.cfs_period_us", "100000")
    cgroup_file(root, "cpu,cpuacct", "cpu.cfs_quota_us", "-1")  # the root: no quota
    cgroup_file(root, "cpu,cpuacct", "cpu.cfs_period_us", "100000")
    assert rt.cgroup_cpus(proc, root) == 3.0


@pytest.fixture
def machine(monkeypatch):
    """4 physical cores allowed, no quota, no $OMP_NUM_THREADS, nobody else busy: each test changes one."""
    monkeypatch.delenv(rt.OMP_ENV, raising=False)
    monkeypatch.setattr(rt, "allowed_cpus", lambda: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(rt, "physical_cores", lambda cpus: len(cpus) // 2)
    monkeypatch.setattr(rt, "cgroup_cpus", lambda: None)
    monkeypatch.setattr(rt, "busy_now", lambda sample_s=rt.SAMPLE_S: 0.0)
    return monkeypatch


def test_default_is_the_physical_cores_of_the_affinity(machine):
    assert rt.default_threads() == 4
    machine.setattr(rt, "allowed_cpus", lambda: {0, 1})
    assert rt.default_threads() == 1


def test_the_cgroup_quota_caps_the_default_rounded_down(machine):
    machine.setattr(rt, "cgroup_cpus", lambda: 2.5)
    assert rt.usable_cores() == 2 and rt.default_threads() == 2
    machine.setattr(rt, "cgroup_cpus", lambda: 0.5)
    assert rt.default_threads() == 1
    machine.setattr(rt, "cgroup_cpus", lambda: 16.0)
    assert rt.default_threads() == 4


@pytest.mark.parametrize(
    "busy,expected", [(0.0, 4), (0.2, 4), (0.3, 3), (1.0, 3), (1.3, 2), (2.0, 2), (9.0, 1)]
)
def test_cores_other_processes_keep_busy_are_left_out(machine, busy, expected):
    assert rt.default_threads(busy=busy) == expected
    machine.setattr(rt, "busy_now", lambda sample_s=rt.SAMPLE_S: busy)
    assert rt.default_threads() == expected


def test_without_proc_stat_the_load_average_beyond_this_process(machine):
    machine.setattr(rt, "busy_now", lambda sample_s=rt.SAMPLE_S: None)
    machine.setattr(rt.os, "getloadavg", lambda: (2.0, 2.0, 2.0))  # this process and one other
    assert rt.default_threads() == 3


def test_omp_num_threads_is_the_users_choice(machine):
    machine.setattr(rt, "busy_now", lambda sample_s=rt.SAMPLE_S: 3.0)
    machine.setenv(rt.OMP_ENV, "3")
    assert rt.default_threads() == 3  # neither capped by the cores nor lowered by the load: asked for
    machine.setenv(rt.OMP_ENV, "6,2")  # nested levels: the first
    assert rt.default_threads() == 6
    machine.setenv(rt.OMP_ENV, "lots")
    with pytest.warns(UserWarning, match="OMP_NUM_THREADS='lots' is not a positive thread count"):
        assert rt.default_threads() == 1  # ignored: 4 cores less 3 busy


def test_resolve_threads(machine):
    assert rt.resolve_threads(None) == 4 and rt.resolve_threads(3) == 3
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(PrecastError, match=r"precast.compile: threads=.*give a positive int") as err:
            rt.resolve_threads(bad, "precast.compile")
        assert "\n" not in str(err.value)


def test_the_real_machine_gives_a_count_in_range():
    cores = rt.usable_cores()
    assert 1 <= cores <= (os.cpu_count() or cores)
    assert rt.physical_cores(rt.allowed_cpus()) <= len(rt.allowed_cpus())
    assert 1 <= rt.default_threads(busy=0.0) <= max(cores, rt.env_threads() or 0)


def test_running_at_sets_the_count_for_the_block_and_restores_it():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with rt.running_at(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError), rt.running_at(other):
        raise ValueError("the call failed")
    assert torch.get_num_threads() == before
    with rt.running_at(before):  # already the count: nothing set
        assert torch.get_num_threads() == before


def test_other_processes_busy_is_all_cpu_time_less_this_processs():
    """What other processes took while precast watched (all CPU time less this process's and its children's), not
    the load average, which counts precast's own work too."""
    assert rt.others_busy((100.0, 10.0), (103.0, 10.5), 2.0) == 1.25  # 3 s in all, 0.5 s precast's
    assert rt.others_busy((0.0, 0.0), (1.0, 1.0), 2.0) == 0.0  # only precast itself
    assert rt.others_busy(None, (1.0, 1.0), 2.0) is None  # no /proc/stat
    assert rt.cpu_seconds() is None or len(rt.cpu_seconds()) == 2
    busy = rt.busy_now(0.05)
    assert busy is None or busy >= 0.0
