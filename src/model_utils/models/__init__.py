"""The model, above data: built from a preset or loaded pretrained (build.py: also its FLOPs and parameter groups), the
GPU memory it needs (memory.py), LoRA's adapters through peft (lora.py), QLoRA's 4-bit base through bitsandbytes
(quantization.py), the speed options applied to it (speed.py), the validation loss without full-vocabulary logits
(evaluation.py), its export to a Hugging Face directory (export.py) and text generation from one (generate.py).
"""
