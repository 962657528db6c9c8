"""``python -m rayvl.cli ...``: the ``rayvl`` command."""
import sys

from rayvl.cli import main

sys.exit(main())
