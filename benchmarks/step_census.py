"""The step census lives in the package now: ``rayvl check census`` (rayvl/checks/census.py). This path stays for
a checkout's ``python benchmarks/step_census.py ...``: same flags, same output."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's rayvl, installed or not

from rayvl.checks.census import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
