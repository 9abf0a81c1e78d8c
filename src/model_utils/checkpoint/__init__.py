"""Checkpoints that count only when complete, above config: protocol.py (the layout, what is complete, the resume point,
incomplete ones moved aside, the universal conversion for another world size), save.py (every rank's writes, the
manifest and `latest` committed last, write failures with their fix, retention), background.py (the host copy and
the writes off the training's critical path). docs/CHECKPOINTS.md tells the guarantees and the tests that hold them.
"""
