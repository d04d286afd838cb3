"""Per-case time and memory of the malformed-GGUF corpus (tests/gguf/test_malformed.py), API and CLI
(one child process per case). Usage: python tools/malformed_report.py > bench/reports/malformed-corpus.txt"""
import subprocess, sys, tempfile, time, tracemalloc
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gguf.test_malformed import CASES
from muser.model.loader import open_model
d = Path(tempfile.mkdtemp())
rows = []
for c in CASES:
    p = d / f"{c.name}.gguf"; c.build(p)
    best = None
    for _ in range(3):
        tracemalloc.start(); t = time.perf_counter()
        try:
            open_model(p).close(); err = None
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t; _, peak = tracemalloc.get_traced_memory(); tracemalloc.stop()
        best = dt if best is None else min(best, dt)
    probe = ("import resource,subprocess,sys,time\nt=time.perf_counter()\n"
             "r=subprocess.run([sys.executable,'-m','muser','inspect',sys.argv[1]],capture_output=True,text=True)\n"
             "print(r.returncode, round(time.perf_counter()-t,3), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.stderr.strip().splitlines()[-1][:120])")
    out = subprocess.run([sys.executable, '-c', probe, str(p)], capture_output=True, text=True).stdout.split(' ', 3)
    rows.append((c.name, p.stat().st_size, best * 1000, peak / 1024, int(out[0]), float(out[1]), int(out[2]) / 1024, out[3].strip(), err))
print(f"{'case':34s} {'bytes':>6s} {'API ms':>7s} {'API KiB':>8s} {'rc':>3s} {'CLI s':>6s} {'CLI MiB':>7s}  error (CLI line)")
for r in rows:
    print(f"{r[0]:34s} {r[1]:6d} {r[2]:7.2f} {r[3]:8.1f} {r[4]:3d} {r[5]:6.3f} {r[6]:7.1f}  {r[7]}")
print(f"\n{len(rows)} cases; API max {max(r[2] for r in rows):.2f} ms, max traced peak {max(r[3] for r in rows):.1f} KiB; "
      f"CLI max wall {max(r[5] for r in rows):.3f} s (whole interpreter start), max RSS {max(r[6] for r in rows):.1f} MiB; all rc=2: {all(r[4]==2 for r in rows)}")
