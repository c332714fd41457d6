"""The checkpoint lifecycle: saving a run's weights, who may read a checkpoint, publishing, TTLs, copies,
deletion and the sweep of expired ones.

Routes call these functions with the few collaborators they need (`Checkpoints`: the journal, the
files' directory, the pins, the limits). File layouts are `server/lora/checkpoint_io.py`'s, tinker://
paths and version directories `server/store/checkpoints.py`'s. Knows nothing about HTTP.
"""
