"""Fine-tuning examples, above the rest of data/: formats.py (row formats, their checks, the chat template),
encode.py (rows -> token ids with labels on the answers), packing.py (examples placed whole into blocks, positions
restarting at each), cache.py (the packed examples cached and opened on every rank). The embedded chats are
data/chat_corpus.py's.
"""
