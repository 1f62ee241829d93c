"""The Ray launcher's teardown of its local Ray instance, without Ray: a process tree that keeps
writing files into the instance's temporary directory (as Ray's daemons write logs and sockets)
is stopped, the directory removed, the processes killed, and nothing comes back.

It runs in a process of its own: the teardown acts on every process under the caller.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import itertools, json, os, subprocess, sys, tempfile, time
from backfill.entrypoints.ray_serve import launcher

temp_dir = tempfile.mkdtemp(prefix="backfill-ray-test-")
# Each writer puts the directory back if it is gone, then a new file in it, as fast as it can.
writer = ("import itertools, os, sys\n"
          "d = sys.argv[1]\n"
          "for i in itertools.count():\n"
          "    os.makedirs(d, exist_ok=True)\n"
          "    open(os.path.join(d, f'{os.getpid()}-{i}'), 'w').close()\n")
spawner = "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]])\n" + writer
subprocess.Popen([sys.executable, "-c", spawner, temp_dir, writer])  # a writer, and a writer under it

deadline = time.monotonic() + 60
while len({name.split("-")[0] for name in os.listdir(temp_dir)}) < 2:  # both write
    assert time.monotonic() < deadline, "the writers never started"
    time.sleep(0.01)
pids = launcher._descendants(os.getpid())
started = time.monotonic()
launcher._remove_local_ray(temp_dir)
took = time.monotonic() - started
time.sleep(0.5)  # anything left would write again
print(json.dumps({"pids": len(pids), "alive": [p for p in pids if launcher._is_alive(p)],
                  "exists": os.path.exists(temp_dir), "took": took}))
"""


def test_the_local_ray_teardown_stops_writers_removes_the_directory_and_kills_them() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pids"] == 2
    assert result["alive"] == []
    assert not result["exists"]
    # each wait is bounded (launcher.KILL_WAIT_S), however the processes behave
    assert result["took"] < 10
