"""Each paper's method in one place. A method contributes, through small interfaces, what it changes at each stage
of a run; the config check, the data pipeline and the training loop iterate over the enabled methods and name none
of them.

- ``<method>/check.py``: ``check(cfg)`` — its config constraints, each error naming the dotted key (torch-free:
  ``rayvl.config`` calls it).
- ``<method>/rows.py``: its row transform (``base.RowTransform``), run inside Ray Data's read tasks (torch-free),
  and what the driver resolves for it before the run starts.
- ``<method>/train.py``: its training part (``base.TrainPart``): a batch source, the loss targets, a train-state
  component, metrics and what it does after a step, on every worker.

Papers: [BoW] Bag-of-Words captions and the memory bank, [TOnICS] ontology-bucketed curriculum minibatches,
[UniCL] image-label data in the contrastive loss, [Paraphrase] text strategies and paraphrase metrics.
"""
