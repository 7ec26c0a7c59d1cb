"""glibc's malloc thresholds: fixed by keep_freed_memory, unless the environment chose its own.

Each case runs in a fresh interpreter (the thresholds are process-wide) that mallocs 8 MiB and
reports whether glibc served it by mmap (``mallinfo2().hblkhd``): under glibc's default 128 KiB
threshold it does, under keep_freed_memory's 32 MiB it must not.
"""

import os
import platform
import subprocess
import sys

import pytest

from flexmoba.host_memory import user_chose_malloc_settings

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

PROBE = """
import ctypes, sys
from flexmoba.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(kept, libc.mallinfo2().hblkhd - before >= 8 << 20)
"""


def probe(mode: str, **env: str) -> tuple[str, str]:
    """(what keep_freed_memory returned, whether an 8 MiB malloc was mmapped) in a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], out[1]


def test_default_glibc_maps_an_8_mib_block_afresh():
    assert probe("default") == ("None", "True")


def test_keep_freed_memory_serves_it_from_the_heap():
    assert probe("keep") == ("True", "False")


def test_thresholds_the_environment_sets_are_left_alone():
    assert probe("keep", MALLOC_MMAP_THRESHOLD_=str(1 << 20)) == ("False", "True")


@pytest.mark.parametrize("env, chosen", [
    ({}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}, True),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=4096"}, False),
    ({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, True),
])
def test_user_choices_are_read_from_the_environment(env, chosen):
    assert user_chose_malloc_settings(env) is chosen
