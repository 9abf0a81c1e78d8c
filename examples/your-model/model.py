"""A model of your own: a tiny image encoder feeding a tiny language model, in plain torch.nn.

    python src/train_deepspeed.py --model examples/your-model/model.py:build \\
        --dataset examples/your-model/data.py:build --config examples/your-model/stages.yaml

The trainer imports this file and calls `build(settings)` once, after seeding torch, so the weights are the same on
every run and every rank. `settings.args` holds the run file's `model_args:`, `settings.tokenizer` the tokenizer and
`settings.seq_len` the most text tokens an item holds. The module's `forward` takes the items of `data.py` as keyword
arguments and returns {"loss": mean loss, "tokens": how many targets it averaged}; the trainer does the rest
(DeepSpeed, precision, the stages' freezing, checkpoints). `parameter_groups` and `flops` are optional.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 32  # data.py resizes every picture to 3 x 32 x 32, its pixels in [0, 1]
# Each channel's mean and spread over the training pictures (mostly white paper): the encoder subtracts the one and
# divides by the other, as every vision model does with its own data's figures. Without it the few coloured patches
# barely move the features, and the decoder learns to answer from the question alone, ignoring the image.
PIXEL_MEAN, PIXEL_STD = (0.90, 0.88, 0.86), (0.19, 0.21, 0.25)


class ImageEncoder(nn.Module):
    """Patches of the image, each a vector (a strided convolution), then a few transformer blocks over the patches."""

    def __init__(self, width, layers, heads, patch):
        super().__init__()
        self.patches = (IMAGE_SIZE // patch) ** 2
        self.register_buffer("mean", torch.tensor(PIXEL_MEAN).view(3, 1, 1), persistent=False)  # not trained
        self.register_buffer("std", torch.tensor(PIXEL_STD).view(3, 1, 1), persistent=False)
        self.patch = nn.Conv2d(3, width, kernel_size=patch, stride=patch)  # one output pixel per patch
        self.position = nn.Parameter(torch.randn(self.patches, width) * 0.02)  # learned: where each patch sits
        self.blocks = nn.ModuleList(Block(width, heads, causal=False) for _ in range(layers))  # every patch sees all
        self.norm = nn.LayerNorm(width)

    def forward(self, pixels):  # (batch, 3, 32, 32) in [0, 1] -> (batch, patches, width)
        x = self.patch((pixels - self.mean) / self.std).flatten(2).transpose(1, 2) + self.position
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)). Causal: a position sees itself and those before.
    Each module's forward uses its own parameters (or calls its children): DeepSpeed's ZeRO-3 gathers a module's
    weights as its forward starts, so a forward reading a child's weight directly would find it partitioned."""

    def __init__(self, width, heads, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)  # queries, keys and values in one matrix
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (batch, heads, length, width / heads)
        x = x + self.out(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """The language model's body: token embeddings, learned positions, causal blocks, a final norm."""

    def __init__(self, vocab, positions, width, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(positions, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, x):  # x: (batch, length, width), the image tokens already in front of the embedded text
        x = x + self.position[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class YourModel(nn.Module):
    """encoder -> projector -> decoder -> head; the names of these four are what a stage's train: or freeze: name."""

    def __init__(self, vocab, seq_len, width=64, encoder_layers=2, decoder_layers=2, heads=4, patch=4):
        super().__init__()
        self.encoder = ImageEncoder(width, encoder_layers, heads, patch)
        self.projector = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.decoder = Decoder(vocab, self.encoder.patches + seq_len, width, decoder_layers, heads)
        self.head = nn.Linear(width, vocab, bias=False)  # its own matrix, not tied to decoder.embed
        self.width, self.encoder_layers, self.decoder_layers = width, encoder_layers, decoder_layers

    def forward(self, pixels, input_ids, labels):
        # Under bf16 the trainer casts the weights, not the batch: bring the pixels to the weights' type.
        pixels = pixels.to(self.encoder.patch.weight.dtype)
        image = self.projector(self.encoder(pixels))  # (batch, patches, width), now in the decoder's space
        text = self.decoder.embed(input_ids)  # (batch, text tokens, width)
        hidden = self.decoder(torch.cat([image, text], dim=1))  # image tokens first, then the text
        logits = self.head(hidden[:, image.shape[1]:])  # only the text positions are scored
        # labels[t] is already the target of text position t (data.py shifted them); -100 is no target.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        tokens = (labels != -100).sum()
        return {"loss": loss / tokens.clamp(min=1), "tokens": tokens}

    def parameter_groups(self):
        """{group: module-name prefixes}: the names a stage's `train:` or `freeze:` may use besides module names."""
        return {"encoder": ["encoder"], "projector": ["projector"], "language_model": ["decoder", "head"]}

    def flops(self, batch):
        """Training FLOPs of one micro-batch (forward + backward = 3 x forward), the usual convention: 6 x the
        parameters of every matrix (Linear and Conv2d weights; embeddings and positions are lookups, norms and biases
        are small) x the positions it sees, plus 12 x layers x width x length^2 per sequence for attention's scores
        and their use. The encoder and projector see the patches, the decoder patches + text, the head the text."""
        size, text = batch["input_ids"].shape
        patches = self.encoder.patches

        def matrices(module):  # under ZeRO-3 a weight here is a partitioned placeholder: ds_numel is its real size
            return sum(getattr(m.weight, "ds_numel", m.weight.numel()) for m in module.modules()
                       if isinstance(m, (nn.Linear, nn.Conv2d)))

        seen = (matrices(self.encoder) + matrices(self.projector)) * patches
        seen += matrices(self.decoder) * (patches + text) + matrices(self.head) * text  # parameters x positions
        attention = 12 * self.width * (self.encoder_layers * patches ** 2 + self.decoder_layers * (patches + text) ** 2)
        return float(size * (6 * seen + attention))


def build(settings):
    """The entry point: `--model examples/your-model/model.py:build`. Returns the model on the CPU, in float32."""
    args = dict(settings.args or {})  # the run file's model_args: width, encoder_layers, decoder_layers, heads, patch
    return YourModel(vocab=len(settings.tokenizer), seq_len=settings.seq_len, **args)
