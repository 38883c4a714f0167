"""``bench/serve.py``'s split of the machine's CPU time: a process Ray titles as Serve's HTTP
proxy is counted as the proxy, the bench's own process as the client, by the CPU they used."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from bench.serve import cpu_seconds, cpu_time

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"


def test_cpu_is_split_by_the_titles_ray_gives_its_processes(capsys):
    before = cpu_seconds()
    # a process titled as Ray titles the proxy (argv[0]), burning 0.3 s of CPU, then waiting
    proxy = subprocess.Popen(["bash", "-c", f'exec -a "ray::ProxyActor" {sys.executable} -c "$0"; ', BURN + "input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "done"
        t = time.process_time()
        while time.process_time() - t < 0.3:  # the client's own CPU
            pass
        after = cpu_seconds()
    finally:
        proxy.kill()
        proxy.wait()
    assert after["HTTP proxy"] - before.get("HTTP proxy", 0.0) >= 0.25
    assert after["this client"] - before["this client"] >= 0.25
    cpu_time("spec on", 1.0, before, after)
    line = capsys.readouterr().out
    assert re.search(r"CPU over 1\.0 s: .*HTTP proxy \d+\.\d s", line), line
