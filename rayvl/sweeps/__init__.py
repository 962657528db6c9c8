"""Hyperparameter sweeps and paper comparisons on Ray Tune.

- ``spaces``: a search-space file (``tune_spaces/*.yaml``) read into a typed ``Sweep``, checked before Ray starts;
- ``trials``: one trial — the trainer `rayvl train` runs, under the trial's values, and its final numbers;
- ``capacity``: how many trials run at once; ``placement``: what a finished trial's Train run leaves, given back;
- ``runner``: the Tuner over the trials, started or resumed; ``directory``: what a sweep directory holds;
- ``reports``: the trial table, trials.csv, plots and the best recipe;
- ``comparison``: a paper comparison (variants × seeds, one grid or two stages) and its jobs' command line;
  ``comparison_report``: its mean ± std table and figures.
"""
