"""One rank's side of a ``ParallelModel``: the runtime built from its program (``build.py``), the batches it
feeds (``inputs.py``, ``loader.py``), a step and a forward (``step.py``), and the model's state as this rank
stores it (``state.py``, ``model_storage.py``).

Nothing is imported here: each module is imported where it is used.
"""
