"""DeiT's training recipe on timm, and evaluation (``train.py``, ``eval.py``). Importing this package imports none
of its modules; each is imported by name.

The modules, top to bottom (each imports only modules listed below it):

* ``trainer``: the run, as DeiT's main.py: set-up, resume, the epoch loop, checkpoints, export, ``train.py``'s
  entry point.
* ``eval_cli``: ``eval.py``: top-1 / top-5 of a checkpoint, an export, a hub folder or a timm/DeiT ``.pth``.
* ``build``: the run's parts from its config (model and start weights, optimizer, EMA, loss, schedule, loaders),
  gathered in ``Run``, the one object the trainer's loop passes; ``build_model`` and ``fit_state`` serve evaluation.
* ``runlog``: the run's log on rank 0 (stdout, ``log.jsonl``, optional wandb).
* ``checkpoint``: what a checkpoint holds (``Progress``: where the run stands), writing, loading and resuming
  one, and the run directory's checks and repair.
* ``engine``: one training pass (``StepParts`` in, ``EpochResult`` out) and one evaluation pass, as DeiT's
  engine.py, and what they synchronise.
* ``stop``: ``StopRequest``, a signal or ``STOP`` file turned into a stop all ranks agree on.
* ``data``: timm's data pipeline, the samplers (a mid-epoch resume skips what was trained), eval shards.
* ``datasets``: the small data sets written on demand (sklearn digits, Fashion-MNIST).
* ``config``: ``TrainConfig``, YAML configs, ``train.py``'s flags and help, the user errors.
* ``distributed``: process groups and the few collectives the loop uses.
"""
