"""worker/: one process per tensor-parallel rank, after SGLang's ``TpModelWorker``.

- ``tp_worker.py``: ``BaseTpWorker`` (what the scheduler drives), ``TpModelWorker`` (a batch -> a
  forward, sampling now or delayed for the overlap scheduler);
- ``tp_group.py``: spawned ranks over pipes (``TpWorkerGroup``), the leader that sends each step,
  a non-leader's message handler, failure detection;
- ``tp_external.py``: external launch (torchrun / DeepSpeed ranks) over a broadcast;
- ``messages.py``: every message between ranks (step, sample, stop, one frozen dataclass per weight
  operation); their one result is ``rollout.outputs.WeightResult``;
- ``process_exit.py``: a process of ours ending once its work is done, without the interpreter's teardown;
- ``rank_weights.py``: ``RankWeights``, a rank's weight transaction, owned by its ``TpModelWorker``
  (dispatch on the weight message, validate -> TP vote -> copy, update groups, release/resume, reads).

May import: the top-level modules (``batch``, ``outputs``, ``config``), ``executor/``, ``weights/``,
``models/`` and ``layers/``.
"""
