"""A dataset of your own (`--dataset FILE.py:FUNCTION`): a map-style dataset and its collate read as the trainer's
other data are, each rank its share in the seed's order, resumed at the exact item (dataset.py).
"""
