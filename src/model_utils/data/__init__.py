"""What the model reads, above runtime. From the bottom: errors.py (DataError), sources.py (what --dataset names),
loading.py (datasets' loaders, their failures as Problems), blocks.py (packed blocks and the deterministic order that
makes a resume exact), tokens.py (tokenizing into the token cache), and pipeline.py, the front door: `prepare_data`
gives every rank the packed data of a source. Beside them: tokenizer.py, corpus.py and chat_corpus.py (the shipped
tokenizer, the embedded text corpus and chats), progress.py, shards.py and prepare.py (a corpus tokenized ahead of
training), streaming.py (--streaming), mixture.py (weighted datasets) and sft/ (fine-tuning examples).
"""
