"""A model of your own (`--model FILE.py:FUNCTION`): the contract the trainer holds it to (contract.py: what FUNCTION
receives, what the forward returns, the optional hooks and their defaults) and its export and reload (export.py).
docs/YOUR-MODEL.md is the user's side of the same contract.
"""
