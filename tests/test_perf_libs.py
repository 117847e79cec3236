"""How perf_analyzer's libb64 gets into the environment (client/perf/run_perf_analyzer.py), with
stand-ins for apt-get and dpkg-deb: the real ones reach Debian's mirrors, and scripts/setup.sh
runs them on every fresh machine (the perf_analyzer sweep test in test_client_cli.py then runs
instead of being skipped)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from client.perf import run_perf_analyzer as pa

# apt-get: `download` writes a .deb into the working directory once $FAKE_APT/ready exists (the
# package lists), `update` creates it; every call is logged. dpkg-deb -x: the package's layout,
# the soname a link to the versioned file, as Debian ships it.
APT_GET = textwrap.dedent("""\
    #!/bin/sh
    echo "$*" >> "$FAKE_APT/calls"
    case "$1" in
      update) touch "$FAKE_APT/ready" ;;
      download) [ -e "$FAKE_APT/ready" ] || exit 100; echo deb > libb64-0d_1.2-5+b1_amd64.deb ;;
    esac
""")
DPKG_DEB = textwrap.dedent("""\
    #!/bin/sh
    lib="$3/usr/lib/x86_64-linux-gnu"
    mkdir -p "$lib" && echo "the library" > "$lib/libb64.so.0d.1.2" && ln -s libb64.so.0d.1.2 "$lib/libb64.so.0d"
""")


@pytest.fixture
def fake_apt(tmp_path, monkeypatch) -> Path:
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, text in (("apt-get", APT_GET), ("dpkg-deb", DPKG_DEB)):
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    state = tmp_path / "apt"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{tools}:{Path('/usr/bin')}:{Path('/bin')}")
    monkeypatch.setenv("FAKE_APT", str(state))
    monkeypatch.setattr(pa, "LOCAL_LIB_DIR", tmp_path / "venv" / "lib" / "perf_analyzer")
    return state


def test_libb64_is_unpacked_into_the_environment(fake_apt):
    (fake_apt / "ready").touch()
    pa._unpack_libb64()
    assert (pa.LOCAL_LIB_DIR / "libb64.so.0d").read_text() == "the library\n"
    assert not (pa.LOCAL_LIB_DIR / "libb64.so.0d").is_symlink()  # the file, not a link into a gone temp dir
    assert (fake_apt / "calls").read_text() == "download libb64-0d\n"  # no update: the host was left alone
    assert str(pa.LOCAL_LIB_DIR) in pa.perf_env()["LD_LIBRARY_PATH"].split(":")


def test_without_package_lists_root_fetches_them_first(fake_apt, monkeypatch):
    monkeypatch.setattr(pa.os, "geteuid", lambda: 0)
    pa._unpack_libb64()
    assert (fake_apt / "calls").read_text() == "download libb64-0d\nupdate -qq\ndownload libb64-0d\n"
    assert (pa.LOCAL_LIB_DIR / "libb64.so.0d").exists()


def test_a_package_that_cannot_be_had_says_so(fake_apt, monkeypatch):
    monkeypatch.setattr(pa.os, "geteuid", lambda: 1000)  # no update without root
    with pytest.raises(RuntimeError, match=r"could not download Debian's libb64-0d"):
        pa._unpack_libb64()
    assert "update" not in (fake_apt / "calls").read_text()
    assert not pa.LOCAL_LIB_DIR.exists()
