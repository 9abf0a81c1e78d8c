"""Vision-language fine-tuning examples: rows with images, in TRL's vision layout (`messages` whose contents are image
and text parts, `images` the files' paths relative to the JSONL file). shapes.py: the embedded images of coloured
shapes and the questions about them, built offline."""
