"""Checks a user runs on a machine, as commands: ``rayvl check gpu`` (rayvl.checks.gpu: does rayvl train, label and
evaluate on this machine's GPUs, and how fast against a hand-written loop) and ``rayvl check census``
(rayvl.checks.census: what one training step asks of the host, counted on a CPU). Importing this package loads
nothing: each check imports what it needs when it runs (the GPU check refuses a machine without a GPU before Ray is
imported)."""
