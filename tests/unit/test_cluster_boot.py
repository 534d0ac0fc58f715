"""pybroker.cluster.boot: a node tells a restart of its machine from a restart of its
process by the kernel's boot id, kept in its data path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pybroker.cluster import boot
from pybroker.cluster.node import ClusterNode


@pytest.fixture
def booted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Set ids[0] to the boot id the node sees."""
    ids = ["boot-a"]
    monkeypatch.setattr(boot, "boot_id", lambda: ids[0])
    return ids


def test_the_first_run_and_a_process_restart_are_the_same_boot(tmp_path: Path,
                                                               booted: list[str]) -> None:
    d = tmp_path / "cluster"
    assert boot.same_boot(str(d))                   # no file: a first run (or older)
    assert (d / "boot").read_text() == "boot-a\n"
    assert boot.same_boot(str(d))                   # the process again, same boot


def test_a_machine_restart_is_told_once_and_remembered(tmp_path: Path,
                                                       booted: list[str]) -> None:
    d = str(tmp_path)
    boot.same_boot(d)
    booted[0] = "boot-b"
    assert not boot.same_boot(d)
    assert (tmp_path / "boot").read_text() == "boot-b\n"
    assert boot.same_boot(d)                        # this boot's id is kept
    assert not os.path.exists(tmp_path / "boot.tmp")


def test_a_boot_file_that_cannot_be_read_or_replaced_counts_as_a_restart(
        tmp_path: Path, booted: list[str]) -> None:
    """same_boot raises (this boot's id cannot be written); the node takes it as a
    restart of its machine, and its copies catch up before they count."""
    (tmp_path / "cluster" / "boot").mkdir(parents=True)    # not a file
    with pytest.raises(OSError):
        boot.same_boot(str(tmp_path / "cluster"))
    assert ClusterNode._same_boot(str(tmp_path)) is False


def test_a_kernel_that_gives_no_boot_id_changes_nothing(tmp_path: Path,
                                                        booted: list[str]) -> None:
    boot.same_boot(str(tmp_path))
    booted[0] = ""
    assert boot.same_boot(str(tmp_path))


def test_the_boot_id_is_the_kernels_or_the_test_facilitys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(boot.ENV, raising=False)
    real = boot.boot_id()
    if os.path.exists(boot.BOOT_ID_PATH):
        assert len(real) == 36 and real.count("-") == 4
    monkeypatch.setenv(boot.ENV, "fake-1")
    assert boot.boot_id() == "fake-1"


def test_a_clean_stop_is_trusted_on_any_boot_once(tmp_path: Path, booted: list[str]) -> None:
    """A planned reboot: the node stopped cleanly (its logs synced), so its copies
    count on the next boot; that run's own file is not clean until it stops so."""
    d = str(tmp_path)
    boot.same_boot(d)
    boot.stopped_cleanly(d)
    assert (tmp_path / "boot").read_text() == "boot-a clean\n"
    booted[0] = "boot-b"
    assert boot.same_boot(d)                        # clean: trusted on another boot
    assert (tmp_path / "boot").read_text() == "boot-b\n"
    booted[0] = "boot-c"
    assert not boot.same_boot(d)                    # boot-b's run did not stop cleanly
