"""Vision-language models, beside the text ones: build.py (what `--model` names, built or loaded with
AutoModelForImageTextToText, sized on the meta device), parts.py (the vision tower, the projector and the language
model: freezing, a learning rate each, LoRA on the language model), tower.py (the vision tower run on every
micro-batch, images or not, so every rank runs the same collectives) and flops.py (the tower's FLOPs for MFU).
"""
