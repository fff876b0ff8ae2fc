"""Load shapes for kbug.sh: python3 yieldtest.py MODE SECONDS [ARG]."""
import os
import sys
import time

mode, seconds = sys.argv[1], float(sys.argv[2])
end = time.monotonic() + seconds
if mode == "spin":  # a CPU loop
    while time.monotonic() < end:
        pass
elif mode == "spin_yield":  # a CPU loop calling sched_yield, as vLLM's shm_broadcast reader does while it waits
    while time.monotonic() < end:
        os.sched_yield()
elif mode == "waker":  # wakes every ARG seconds and sleeps again, as a thread receiving messages does
    period = float(sys.argv[3])
    while time.monotonic() < end:
        time.sleep(period)
