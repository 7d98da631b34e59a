# Kernels run in Triton's interpreter on a machine without a GPU. The switch must be set
# before triton is first imported (importing a transformers model class imports it).
import os, shutil, subprocess

def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"): return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0

if not _has_gpu(): os.environ.setdefault("TRITON_INTERPRET", "1")
