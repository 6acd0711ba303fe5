"""The compile driver: a model, its loss and a mesh become each rank's program, in this order.

1. ``capture.py``: ``torch.export`` of the model and its loss to one ATen graph (``experts.py`` rewrites
   looping experts first; ``capture_cache.py``, ``export_key.py`` and ``export_files.py`` reuse an export
   within a process and across a job's ranks).
2. ``program.py``: the ``Program`` the passes fill (each rank's graphs, the step schedule, the plan).
3. ``driver.py``: ``compile_program`` runs the ordered passes (tensor sharding, pipeline cuts, the step
   schedule), then ``precision_program.py``, ``zero_program.py`` and ``recompute_program.py`` rewrite every rank's graphs.
4. ``compiled.py``: one program per input shape, cut and sharded as the first.

Nothing is imported here: each module is imported where it is used.
"""
