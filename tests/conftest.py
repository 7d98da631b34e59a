# Kernels run in Triton's interpreter on a machine without a GPU. The switch must be set
# before triton is first imported (importing a transformers model class imports it).
import os
import shutil
import subprocess


def _has_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis profiles. "ci" (chosen when CI=true) is derandomized: every run draws the same
# examples, so a green CI means the same thing twice; it ignores the local example database for the
# same reason. "dev" (the default elsewhere) draws new examples each run and keeps failing ones in
# .hypothesis/. Both print the falsifying example and a `@reproduce_failure(...)` blob to paste
# above the test; `pytest --hypothesis-seed=N` replays a whole "dev" run. HYPOTHESIS_PROFILE=ci|dev
# overrides the choice; tests that set max_examples themselves keep their own budget.
from hypothesis import settings  # noqa: E402 (after the interpreter switch above)

# Both start from hypothesis' "default" profile: hypothesis itself loads a derandomized profile
# when it sees $CI.
_base = settings.get_profile("default")
settings.register_profile(
    "ci", _base, derandomize=True, database=None, print_blob=True, deadline=None, max_examples=50
)
settings.register_profile(
    "dev", _base, derandomize=False, print_blob=True, deadline=None, max_examples=50
)


def hypothesis_profile() -> str:
    "The profile this run uses: $HYPOTHESIS_PROFILE, else 'ci' when $CI is true, else 'dev'."
    if os.environ.get("HYPOTHESIS_PROFILE"):
        return os.environ["HYPOTHESIS_PROFILE"]
    return "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"


settings.load_profile(hypothesis_profile())


def pytest_report_header(config):
    return f"hypothesis profile: {hypothesis_profile()} (CI=true selects 'ci', derandomized)"


import torch  # noqa: E402 (after the interpreter switch above)


class SaysCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA (`x.as_subclass(SaysCuda)`): it takes the CUDA
    branch of a dispatch on a CPU, with the GPU calls it reaches replaced by the test."""

    @property
    def is_cuda(self):
        return True
