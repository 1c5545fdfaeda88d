"""The peak resident memory of a fresh process, for the memory tests: ``WATCH`` (Python source) starts a thread that
samples ``RssAnon + RssShmem`` (what the process holds, not the page cache of the files it maps) every 2 ms into
``peak[0]`` (a daemon thread: a probe whose work fails exits with its error instead of waiting on it); ``REPORT``
stops it and prints the peak. A probe script is ``WATCH``, the work, then ``REPORT``."""

WATCH = """
import threading, time

def resident():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))

peak, done = [0], threading.Event()

def watch():
    while not done.is_set():
        peak[0] = max(peak[0], resident())
        time.sleep(0.002)

watcher = threading.Thread(target=watch, daemon=True)  # a failing probe exits with its error, not waits
watcher.start()
"""
REPORT = """
done.set()
watcher.join()
print(peak[0])
"""
