"""``python -c METERED convert ... --out DIR/X``: ``collab-vit convert`` with the disk it takes beside its output
measured, for the tests of the disk estimate (``tests/test_disk_estimate.py``).

The command runs as a user runs it; this process also records the estimate the conversion checked against the free
disk (``blockwise.check_space``'s ``disk``) and the most bytes the files of ``--out``'s folder took at once: sampled
after each file of the state is created (``Store.empty``) and before each rename of an atomic write (the temporary
copy beside the file it replaces, a folder's staged copy), as every file there in whole blocks of its file system
plus the files removed while still mapped (``/proc/self/maps``), which keep their blocks, less what was there before.
``METER_OUT`` names the JSON file written at exit: ``{"estimate": bytes, "peak": bytes}``.
"""
METERED = r"""
import atexit, json, os, sys
from pathlib import Path
from collab_vit import weights_io
from collab_vit.conversion.calibration import recipe, state

args = sys.argv[1:]
where = Path(args[args.index("--out") + 1]).resolve().parent
block = os.statvfs(where).f_frsize
sizes, seen = {}, {"estimate": None, "peak": 0}


def used():
    files = {}
    for root, _, names in os.walk(where):
        for name in names:
            st = os.stat(os.path.join(root, name))
            files[st.st_ino] = st.st_size
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(where)) and parts[5].rstrip().endswith("(deleted)"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                files.setdefault(int(parts[4]), sizes.get(int(parts[4]), end - start))
    return sum(-(-size // block) * block for size in files.values())


def sample():
    seen["peak"] = max(seen["peak"], used() - before)


before = used()  # an earlier output: already on the disk


real_empty, real_check = state.Store.empty, recipe.check_space


def empty(self, name, *args, **kwargs):
    tensor = real_empty(self, name, *args, **kwargs)
    st = os.stat(self.folder / f"{name}.bin")
    sizes[st.st_ino] = st.st_size
    sample()
    return tensor


def check_space(disk, memory, advice):
    seen["estimate"] = disk
    return real_check(disk, memory, advice)


class Os:  # weights_io's view of the os module: each rename sampled first
    def __getattr__(self, attr):
        return getattr(os, attr)

    @staticmethod
    def replace(src, dst, *rest, **kwargs):
        sample()
        return os.replace(src, dst, *rest, **kwargs)

    @staticmethod
    def rename(src, dst, *rest, **kwargs):  # a new folder output, staged whole
        sample()
        return os.rename(src, dst, *rest, **kwargs)


state.Store.empty, recipe.check_space, weights_io.os = empty, check_space, Os()
atexit.register(lambda: Path(os.environ["METER_OUT"]).write_text(json.dumps(seen)))
from collab_vit.cli import main
main(args)
"""
