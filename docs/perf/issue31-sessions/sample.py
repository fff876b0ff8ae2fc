import sys, time, json
# usage: sample.py seconds name:pid:tid ...
dur = float(sys.argv[1]); specs = [a.split(":") for a in sys.argv[2:]]
prev = {}
t0 = time.monotonic()
while time.monotonic() - t0 < dur:
    row = [f"{time.monotonic()-t0:6.2f}"]
    for name, pid, tid in specs:
        try:
            run, wait, n = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
            st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            row.append(f"{name}:gone"); continue
        pr = prev.get(name, (run, wait, n))
        prev[name] = (run, wait, n)
        row.append(f"{name}:{st} run{(run-pr[0])/1e6:6.1f} wait{(wait-pr[1])/1e6:6.1f} n{n-pr[2]:3d}")
    print(" | ".join(row), flush=True)
    time.sleep(0.25)
