"""Every 0.5 s: per-thread CPU deltas of vLLM processes; print windows where some runnable thread waited > 300 ms
with the top runners of that window."""
import os, sys, time
def procs():
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError: continue
        if comm.startswith("VLLM") or b"vllm.entrypoints" in cmd or b"kvpush" in cmd:
            out.append(int(pid))
    return out
def snap():
    out = {}
    for pid in procs():
        try:
            ag = open(f"/proc/{pid}/autogroup").read().split()[0]
            pc = open(f"/proc/{pid}/comm").read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    run, wait, n = map(int, open(f"/proc/{pid}/task/{tid}/schedstat").read().split())
                    comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
                    st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                    out[int(tid)] = (run, wait, pid, pc, comm, ag, int(st[36]))
                except OSError: pass
        except OSError: pass
    return out
end = time.monotonic() + float(sys.argv[1])
prev = snap()
while time.monotonic() < end:
    time.sleep(0.5)
    cur = snap()
    rows = []
    for tid, v in cur.items():
        p = prev.get(tid)
        if p is None: continue
        rows.append(((v[0]-p[0])/1e6, (v[1]-p[1])/1e6, tid, v))
    prev = cur
    starved = [r for r in rows if r[1] > 300]
    if starved:
        print(time.strftime("%H:%M:%S"), "starved:", ", ".join(f"{r[3][3]}/{r[3][4]}({r[3][5]},cpu{r[3][6]}) wait={r[1]:.0f}" for r in sorted(starved, key=lambda r: -r[1])[:4]))
        for r in sorted(rows, reverse=True)[:4]:
            print(f"     run {r[0]:6.0f}ms {r[3][3]}/{r[3][4]} tid={r[2]} {r[3][5]} cpu{r[3][6]}")
    sys.stdout.flush()
