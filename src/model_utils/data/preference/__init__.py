"""Preference pairs, beside sft/ (whose chat template and answer spans they reuse): formats.py (the rows TRL's
preference datasets hold, their checks, the implicit prompt), encode.py (rows -> a chosen and a rejected example),
packing.py (pairs placed whole into blocks, each sequence's positions restarting), cache.py (the packed pairs cached
and opened on every rank), reference.py (the reference model's log-probabilities of every pair, stored beside them).
"""
