"""The GPU check lives in the package now: ``rayvl check gpu`` (rayvl/checks/gpu.py; ``make gpu-check``). This path
stays because the GPU workflow runs it from a checkout (``bash .devrun/on_gpu.sh python3 benchmarks/gpu_check.py
...``): same flags, same output, same exit codes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's rayvl, installed or not

from rayvl.checks.gpu import main  # noqa: E402 — light: torch and Ray load when it runs

if __name__ == "__main__":
    sys.exit(main())
